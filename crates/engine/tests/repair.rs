//! `condense repair` at the engine: a journal damaged in the middle and a damaged block-map
//! page. Each test computes the blocks it expects lost from what it wrote, and checks that the
//! report names exactly those, that every other block reads back, that verify is clean and
//! that the pool reopens.

mod common;
use common::damage_record_of;
use condense_engine::repair::{self, LostRange, RepairReport};
use condense_engine::{Compression, InitOptions, OpenOptions, Pool, UserKey, WritePolicy};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

const BS: usize = 4096;

fn init(dir: &Path) {
    init_with(dir, None);
}

fn init_with(dir: &Path, key: Option<&UserKey>) {
    let init = InitOptions {
        block_size: BS as u32,
        compression: Compression::None,
        write_policy: WritePolicy::Async,
        segment_bytes_target: 1 << 20,
        metadata_cache_bytes: None,
        encryption: key.cloned(),
    };
    Pool::init_path(dir, &init).expect("init");
}

fn open(dir: &Path) -> Arc<Pool> {
    open_with(dir, None)
}

fn open_with(dir: &Path, key: Option<&UserKey>) -> Arc<Pool> {
    let opts = OpenOptions {
        key: key.cloned(),
        ..Default::default()
    };
    Pool::open_path(dir, opts).expect("open")
}

fn test_key() -> UserKey {
    UserKey::Key(zeroize::Zeroizing::new([7u8; 32]))
}

/// A block no other call makes.
fn unique_block(seed: u64, block: u64) -> Vec<u8> {
    (0..BS / 8)
        .flat_map(|i| (seed << 40 ^ block << 16 ^ i as u64).to_le_bytes())
        .collect()
}

/// What each block of each volume should hold (absent: zeros).
type Model = BTreeMap<(String, u64), Vec<u8>>;

fn write(pool: &Pool, model: &mut Model, vol: &str, block: u64, data: Vec<u8>) {
    pool.volume(vol)
        .and_then(|h| h.write_at(block * BS as u64, &data, false))
        .expect("write");
    model.insert((vol.to_string(), block), data);
}

fn write_range(pool: &Pool, model: &mut Model, vol: &str, seed: u64, from: u64, to: u64) {
    let data: Vec<u8> = (from..to).flat_map(|b| unique_block(seed, b)).collect();
    pool.volume(vol)
        .and_then(|h| h.write_at(from * BS as u64, &data, false))
        .expect("write");
    for b in from..to {
        model.insert((vol.to_string(), b), unique_block(seed, b));
    }
}

fn read_block(pool: &Pool, vol: &str, block: u64) -> Vec<u8> {
    let mut buf = vec![0u8; BS];
    pool.volume(vol)
        .and_then(|h| h.read_at(block * BS as u64, &mut buf))
        .unwrap_or_else(|e| panic!("reading {vol} block {block}: {e}"));
    buf
}

/// The error a read of `block` gives (a block repair declared lost), or a panic if it reads.
fn read_error(pool: &Pool, vol: &str, block: u64) -> String {
    let mut buf = vec![0u8; BS];
    match pool
        .volume(vol)
        .and_then(|h| h.read_at(block * BS as u64, &mut buf))
    {
        Ok(()) => panic!("{vol} block {block} was lost but reads"),
        Err(e) => e.to_string(),
    }
}

/// A lost block fails to read, with an error that names it, until it is written again; a
/// snapshot's lost block stays lost.
fn lost_fails_until_written(pool: &Pool, vol: &str, block: u64) {
    let e = read_error(pool, vol, block);
    assert!(
        e.contains("was lost") && e.contains(&format!("block {block}")),
        "{e}"
    );
    let data = unique_block(99, block);
    let h = pool.volume(vol).expect("volume");
    h.write_at(block * BS as u64, &data, false).expect("write");
    assert!(read_block(pool, vol, block) == data);
}

/// (volume, first block, blocks) of every lost range.
fn lost(report: &RepairReport) -> Vec<(String, u64, u64)> {
    report
        .lost
        .iter()
        .map(
            |LostRange {
                 volume,
                 first_block,
                 blocks,
                 ..
             }| (volume.clone(), *first_block, *blocks),
        )
        .collect()
}

fn is_lost(lost: &[(String, u64, u64)], vol: &str, block: u64) -> bool {
    lost.iter()
        .any(|(v, f, n)| v == vol && (*f..f + n).contains(&block))
}

/// Every block of every volume outside the lost ranges reads what the model says.
fn check_all(pool: &Pool, model: &Model, vols: &[(&str, u64)], lost: &[(String, u64, u64)]) {
    for &(vol, blocks) in vols {
        for b in 0..blocks {
            if is_lost(lost, vol, b) {
                continue;
            }
            let want = model
                .get(&(vol.to_string(), b))
                .cloned()
                .unwrap_or_else(|| vec![0u8; BS]);
            assert!(read_block(pool, vol, b) == want, "{vol} block {b} differs");
        }
    }
}

fn verify_clean(pool: &Pool) {
    let v = pool.verify(&|_, _| {}).expect("verify");
    assert!(v.is_clean(), "verify after repair: {v:?}");
}

/// Byte offsets of the batches of a journal file (after its 64-byte header).
fn batch_offsets(journal: &[u8]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut pos = 64;
    while pos + 24 <= journal.len() {
        let len = u32::from_le_bytes(journal[pos + 4..pos + 8].try_into().expect("4 bytes"));
        let end = pos + 24 + len as usize;
        out.push((pos, end));
        pos = end;
    }
    out
}

fn journal_path(dir: &Path) -> std::path::PathBuf {
    let mut j: Vec<_> = std::fs::read_dir(dir)
        .expect("list")
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("journal-"))
        })
        .collect();
    assert_eq!(j.len(), 1, "one journal: {j:?}");
    j.remove(0)
}

/// Flip a byte inside the metadata page stored at byte `at` of `meta.dat`.
fn damage_meta_page(dir: &Path, at: u64) {
    let meta = dir.join("meta.dat");
    let mut m = std::fs::read(&meta).expect("read meta");
    m[at as usize + 8] ^= 0xff;
    std::fs::write(&meta, &m).expect("damage");
}

/// The pool's metadata files, to check a dry run changes nothing.
fn metadata_files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .expect("list")
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).expect("read"),
            )
        })
        .collect()
}

#[test]
fn journal_damaged_in_the_middle_loses_exactly_that_batch() {
    // Flip the last byte of batch 4 (inside its map run's last entry).
    journal_damage_case(None, |j, _, end| j[end - 1] ^= 0x5a);
}

#[test]
fn encrypted_journal_damaged_in_the_middle_is_repaired_under_a_new_epoch() {
    // Flip a byte of batch 4's header checksum: the sealed payload still authenticates, so
    // repair can name what the batch wrote.
    let key = test_key();
    journal_damage_case(Some(&key), |j, start, _| j[start + 17] ^= 0x5a);
}

fn journal_damage_case(key: Option<&UserKey>, damage: fn(&mut [u8], usize, usize)) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    init_with(dir, key);
    let mut model = Model::new();
    let pool = open_with(dir, key);
    pool.create_volume("vm", 1024 * BS as u64).expect("create"); // batch 1
    pool.create_volume("db", 256 * BS as u64).expect("create"); // batch 2
    write_range(&pool, &mut model, "vm", 1, 0, 100);
    pool.flush().expect("flush"); // batch 3
                                  // Batch 4, to be damaged: its model is what the blocks held before it.
    let before = model.clone();
    write_range(&pool, &mut model, "vm", 2, 100, 150);
    write_range(&pool, &mut model, "db", 2, 10, 20);
    pool.flush().expect("flush"); // batch 4
                                  // Batch 5 rewrites part of batch 4 and deduplicates against one of its chunks: that
                                  // chunk's creation is in the damaged batch, so repair must find it in the segments.
    write_range(&pool, &mut model, "vm", 3, 120, 130);
    write_range(&pool, &mut model, "vm", 3, 200, 260);
    write(&pool, &mut model, "vm", 300, unique_block(2, 110));
    pool.flush().expect("flush"); // batch 5
    drop(pool); // a crash: no checkpoint, the journal holds everything

    let jpath = journal_path(dir);
    let mut j = std::fs::read(&jpath).expect("read journal");
    let batches = batch_offsets(&j);
    assert_eq!(batches.len(), 5, "batches {batches:?}");
    let (start, end) = batches[3];
    damage(&mut j, start, end);
    std::fs::write(&jpath, &j).expect("damage");

    // Opening refuses, and says what to do.
    let opts = OpenOptions {
        key: key.cloned(),
        ..Default::default()
    };
    let err = Pool::open_path(dir, opts)
        .err()
        .expect("open must fail on mid-journal damage")
        .to_string();
    assert!(err.contains("condense repair"), "{err}");

    // A dry run reports and changes nothing.
    let files = metadata_files(dir);
    let dry = repair::repair(dir, true, key.cloned(), &|_, _| {}).expect("dry run");
    assert_eq!(metadata_files(dir), files, "the dry run changed files");
    assert!(dry.backup.is_none());

    // Lost: batch 4's blocks that batch 5 did not write again.
    let expected = vec![
        ("db".to_string(), 10, 10),
        ("vm".to_string(), 100, 20),
        ("vm".to_string(), 130, 20),
    ];
    assert_eq!(lost(&dry), expected, "{dry:?}");
    assert_eq!(dry.damaged_journal.len(), 1);

    let report = repair::repair(dir, false, key.cloned(), &|_, _| {}).expect("repair");
    assert_eq!(lost(&report), expected, "{report:?}");
    assert_eq!(report.chunks_from_segments, 1, "{report:?}");
    let backup = report.backup.clone().expect("backup");
    assert!(backup.join(jpath.file_name().expect("name")).exists());
    assert!(backup.join("checkpoint").exists() && backup.join("meta.dat").exists());

    let pool = open_with(dir, key);
    let vols = [("vm", 1024), ("db", 256)];
    check_all(&pool, &model, &vols, &expected);
    // Lost blocks keep what they held before the damaged batch.
    for (vol, first, n) in &expected {
        for b in *first..first + n {
            let want = before
                .get(&(vol.clone(), b))
                .cloned()
                .unwrap_or_else(|| vec![0u8; BS]);
            assert!(read_block(&pool, vol, b) == want, "{vol} block {b}");
        }
    }
    verify_clean(&pool);
    if key.is_some() {
        // Sealed under the new epoch: nothing of the pool reads without the key.
        let plain = Pool::open_path(dir, OpenOptions::default());
        assert!(plain.is_err(), "an encrypted pool opened without its key");
    }
    // The repaired pool takes writes and survives a clean reopen.
    write_range(&pool, &mut model, "vm", 4, 500, 510);
    pool.close().expect("close");
    drop(pool);
    let pool = open_with(dir, key);
    check_all(&pool, &model, &vols, &expected);
    verify_clean(&pool);
}

#[test]
fn damaged_block_map_page_loses_its_blocks_in_every_volume_that_shares_it() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    init(dir);
    let mut model = Model::new();
    let pool = open(dir);
    pool.create_volume("vm", 4096 * BS as u64).expect("create");
    pool.create_volume("other", 1024 * BS as u64)
        .expect("create");
    write_range(&pool, &mut model, "vm", 1, 0, 2048);
    write_range(&pool, &mut model, "other", 1, 0, 600);
    pool.create_snapshot("vm", "s1").expect("snapshot");
    for b in 0..2048 {
        model.insert(("vm@s1".into(), b), unique_block(1, b));
    }
    // The volume moves on from its snapshot in leaf 0 only.
    write_range(&pool, &mut model, "vm", 2, 0, 10);
    pool.close().expect("close");
    // Leaf 2 (blocks 1024..1536) is shared by vm and vm@s1.
    let at = repair::map_page_offset(&pool, "vm", 1024)
        .expect("locate")
        .expect("written page");
    assert_eq!(
        repair::map_page_offset(&pool, "vm@s1", 1024).expect("locate"),
        Some(at)
    );
    drop(pool);
    damage_meta_page(dir, at);

    // Opening works (the page is read on demand) but reading it fails.
    {
        let pool = open(dir);
        let mut buf = vec![0u8; BS];
        let h = pool.volume("vm").expect("volume");
        assert!(h.read_at(1100 * BS as u64, &mut buf).is_err());
        assert!(!pool.verify(&|_, _| {}).expect("verify").is_clean());
    }

    let report = repair::repair(dir, false, None, &|_, _| {}).expect("repair");
    let expected = vec![
        ("vm".to_string(), 1024, 512),
        ("vm@s1".to_string(), 1024, 512),
    ];
    assert_eq!(lost(&report), expected, "{report:?}");
    assert!(report.unreadable_map_pages >= 2, "{report:?}");

    let pool = open(dir);
    let vols = [("vm", 4096), ("vm@s1", 4096), ("other", 1024)];
    check_all(&pool, &model, &vols, &expected);
    // Lost blocks fail to read (never zeros taken for data), in the snapshot too.
    read_error(&pool, "vm@s1", 1100);
    verify_clean(&pool);
    lost_fails_until_written(&pool, "vm", 1100);
    model.insert(("vm".into(), 1100), unique_block(99, 1100));
    verify_clean(&pool);
    // The snapshot is still a snapshot.
    let h = pool.volume("vm@s1").expect("snapshot");
    assert!(h.write_at(0, &vec![1u8; BS], false).is_err());
    drop(h);
    pool.close().expect("close");
    drop(pool);
    let pool = open(dir);
    check_all(&pool, &model, &vols, &expected);
    read_error(&pool, "vm", 1101);
    verify_clean(&pool);
}

#[test]
fn repair_refuses_a_pool_in_use_and_leaves_a_healthy_pool_alone() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    init(dir);
    let pool = open(dir);
    pool.create_volume("vm", 64 * BS as u64).expect("create");
    let err = repair::repair(dir, false, None, &|_, _| {})
        .expect_err("pool is held")
        .to_string();
    assert!(err.contains("in use"), "{err}");
    pool.close().expect("close");
    drop(pool);
    let files = metadata_files(dir);
    let report = repair::repair(dir, false, None, &|_, _| {}).expect("repair");
    assert!(!report.found_damage(), "{report:?}");
    assert!(report.backup.is_none());
    assert_eq!(metadata_files(dir), files);
}

#[test]
fn damaged_chunk_table_page_is_rebuilt_from_the_segments() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    init(dir);
    let mut model = Model::new();
    let pool = open(dir);
    pool.create_volume("vm", 1024 * BS as u64).expect("create");
    // 600 unique blocks: chunks 0..600, 128 to a chunk-table page.
    write_range(&pool, &mut model, "vm", 1, 0, 600);
    pool.close().expect("close");
    let at = repair::chunk_page_offset(&pool, 200)
        .expect("locate")
        .expect("written page");
    drop(pool);
    damage_meta_page(dir, at);
    {
        let pool = open(dir);
        let mut buf = vec![0u8; BS];
        let h = pool.volume("vm").expect("volume");
        assert!(h.read_at(200 * BS as u64, &mut buf).is_err());
    }

    let report = repair::repair(dir, false, None, &|_, _| {}).expect("repair");
    // Every chunk of the page (ids 128..256) is found again in the segments: nothing lost.
    assert_eq!(lost(&report), vec![], "{report:?}");
    assert_eq!(report.unreadable_chunk_pages, 1, "{report:?}");
    assert_eq!(report.chunks_from_segments, 128, "{report:?}");
    assert!(report.found_damage());

    let pool = open(dir);
    check_all(&pool, &model, &[("vm", 1024)], &[]);
    verify_clean(&pool);
}

#[test]
fn newest_chunk_made_in_a_damaged_batch_and_shared_later_is_found_once() {
    // The damaged batch makes the pool's newest chunks; the later batch only deduplicates
    // against them (several blocks, one chunk), so their ids are past every id the salvaged
    // batches know and each must be taken from the segments once.
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    init(dir);
    let mut model = Model::new();
    let pool = open(dir);
    pool.create_volume("vm", 64 * BS as u64).expect("create"); // batch 1
    write_range(&pool, &mut model, "vm", 1, 0, 4);
    pool.flush().expect("flush"); // batch 2
    write_range(&pool, &mut model, "vm", 2, 4, 8);
    pool.flush().expect("flush"); // batch 3, to be damaged
    for b in 20..23 {
        write(&pool, &mut model, "vm", b, unique_block(2, 5));
    }
    pool.flush().expect("flush"); // batch 4: three blocks naming batch 3's chunk of block 5
    drop(pool);

    let jpath = journal_path(dir);
    let mut j = std::fs::read(&jpath).expect("read journal");
    let batches = batch_offsets(&j);
    assert_eq!(batches.len(), 4, "batches {batches:?}");
    let (_, end) = batches[2];
    j[end - 1] ^= 0x5a;
    std::fs::write(&jpath, &j).expect("damage");

    let report = repair::repair(dir, false, None, &|_, _| {}).expect("repair");
    let expected = vec![("vm".to_string(), 4, 4)];
    assert_eq!(lost(&report), expected, "{report:?}");
    assert_eq!(report.chunks_from_segments, 1, "{report:?}");
    let pool = open(dir);
    check_all(&pool, &model, &[("vm", 64)], &expected);
    verify_clean(&pool);
}

/// A lost segment (a writeback cache device that died): its blocks are reported lost and read
/// as zeros. Chunk ids are handed out again after a crash takes writes back, so the segments
/// can hold an older record with the same id and other data; repair must not take it.
#[test]
fn blocks_of_a_missing_segment_are_lost_not_taken_from_a_record_a_crash_took_back() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    init(dir);
    let mut model = Model::new();
    let pool = open(dir);
    pool.create_volume("a", 64 * BS as u64).expect("create");
    write_range(&pool, &mut model, "a", 1, 0, 8);
    pool.close().expect("close");
    drop(pool);

    // Written but never flushed, then the process dies: the records stay in a segment file,
    // the journal never names them, and their ids are handed out again.
    let pool = open(dir);
    let mut gone = Model::new();
    write_range(&pool, &mut gone, "a", 2, 8, 16);
    drop(pool);

    let pool = open(dir);
    for b in 8..16 {
        model.remove(&("a".to_string(), b));
    }
    write_range(&pool, &mut model, "a", 3, 16, 24);
    pool.close().expect("close");
    drop(pool);
    let newest = std::fs::read_dir(dir)
        .expect("list")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("seg-") && n.ends_with(".dat"))
        .max()
        .expect("a segment");
    std::fs::remove_file(dir.join(&newest)).expect("remove the newest segment");

    let report = repair::repair(dir, false, None, &|_, _| {}).expect("repair");
    let lost = lost(&report);
    assert_eq!(lost, vec![("a".to_string(), 16, 8)], "report: {report:?}");
    let pool = open(dir);
    for b in 16..24 {
        // An error, not the data of a write a crash took back.
        read_error(&pool, "a", b);
    }
    check_all(&pool, &model, &[("a", 64)], &lost);
    verify_clean(&pool);
}

#[test]
fn damaged_chunk_record_loses_the_blocks_naming_it_in_every_volume_and_snapshot() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    init(dir);
    let mut model = Model::new();
    let pool = open(dir);
    pool.create_volume("vm", 1024 * BS as u64).expect("create");
    pool.create_volume("other", 64 * BS as u64).expect("create");
    write_range(&pool, &mut model, "vm", 1, 0, 600);
    // A duplicate of vm's block 100: the same chunk.
    write(&pool, &mut model, "other", 0, unique_block(1, 100));
    write(&pool, &mut model, "other", 1, unique_block(3, 1));
    pool.create_snapshot("vm", "s1").expect("snapshot");
    for b in 0..600 {
        model.insert(("vm@s1".into(), b), unique_block(1, b));
    }
    pool.close().expect("close");
    drop(pool);
    damage_record_of(dir, &unique_block(1, 100));

    let expected = vec![
        ("other".to_string(), 0, 1),
        ("vm".to_string(), 100, 1),
        ("vm@s1".to_string(), 100, 1),
    ];
    {
        // Before: reads of the block fail, verify names it in every volume.
        let pool = open(dir);
        let mut buf = vec![0u8; BS];
        let h = pool.volume("vm").expect("volume");
        assert!(h.read_at(100 * BS as u64, &mut buf).is_err());
        let v = pool.verify(&|_, _| {}).expect("verify");
        assert_eq!(v.bad_chunks.len(), 1, "{v:?}");
        let named: Vec<(String, u64, u64)> = v
            .bad_blocks
            .iter()
            .flat_map(|(vol, bs)| bs.iter().map(move |&b| (vol.clone(), b, 1)))
            .collect();
        assert_eq!(named, expected, "{v:?}");
    }
    let dry = repair::repair(dir, true, None, &|_, _| {}).expect("dry run");
    assert_eq!((dry.damaged_chunks, lost(&dry)), (1, expected.clone()));
    let report = repair::repair(dir, false, None, &|_, _| {}).expect("repair");
    assert_eq!(lost(&report), expected, "{report:?}");
    assert!(report.chunks_checked >= 601, "{report:?}");
    assert!(
        report.lost[0].reason.contains("damaged record"),
        "{report:?}"
    );

    let pool = open(dir);
    let vols = [("vm", 1024), ("vm@s1", 1024), ("other", 64)];
    check_all(&pool, &model, &vols, &expected);
    read_error(&pool, "vm", 100);
    read_error(&pool, "vm@s1", 100);
    verify_clean(&pool);
    // The loss is kept in the pool's history, and verify (clean) still lists it...
    let history = repair::damage_history(&pool);
    assert_eq!(history.len(), 1);
    assert_eq!(history[0].lost, report.lost);
    let v = pool.verify(&|_, _| {}).expect("verify");
    assert_eq!(v.accepted, history);
    pool.close().expect("close");
    drop(pool);
    // ...across a reopen, until cleared.
    let pool = open(dir);
    assert_eq!(repair::damage_history(&pool), history);
    assert_eq!(repair::clear_damage_history(&pool).expect("clear"), 1);
    pool.close().expect("close");
    drop(pool);
    let pool = open(dir);
    assert!(repair::damage_history(&pool).is_empty());
    drop(pool);
    // Nothing left to repair.
    let again = repair::repair(dir, true, None, &|_, _| {}).expect("dry run");
    assert!(!again.found_damage(), "{again:?}");
}

/// `lost_as_zeros`: the blocks of a damaged chunk read as zeros after the repair (and a handle
/// set to read lost blocks as zeros counts them).
#[test]
fn lost_as_zeros_leaves_zeros_where_the_report_says() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    init(dir);
    let mut model = Model::new();
    let pool = open(dir);
    pool.create_volume("vm", 256 * BS as u64).expect("create");
    write_range(&pool, &mut model, "vm", 5, 0, 200);
    pool.close().expect("close");
    drop(pool);
    damage_record_of(dir, &unique_block(5, 42));
    let report = repair::repair_with(
        dir,
        repair::RepairOptions {
            lost_as_zeros: true,
            ..Default::default()
        },
        &|_, _| {},
    )
    .expect("repair");
    let expected = vec![("vm".to_string(), 42, 1)];
    assert_eq!(lost(&report), expected, "{report:?}");
    assert!(
        report.lost[0].reason.contains("read as zeros"),
        "{report:?}"
    );
    let pool = open(dir);
    check_all(&pool, &model, &[("vm", 256)], &expected);
    assert!(read_block(&pool, "vm", 42) == vec![0u8; BS]);
    assert_eq!(
        pool.lost_blocks_read_as_zeros(),
        0,
        "zeros, not lost entries"
    );
    verify_clean(&pool);
}

/// A handle told to read lost blocks as zeros (`export --lost-as-zeros`) reads them as zeros
/// and counts them; other handles still fail.
#[test]
fn lost_blocks_read_as_zeros_only_where_asked() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    init(dir);
    let mut model = Model::new();
    let pool = open(dir);
    pool.create_volume("vm", 64 * BS as u64).expect("create");
    write_range(&pool, &mut model, "vm", 6, 0, 64);
    pool.close().expect("close");
    drop(pool);
    damage_record_of(dir, &unique_block(6, 7));
    let report = repair::repair(dir, false, None, &|_, _| {}).expect("repair");
    assert_eq!(lost(&report), vec![("vm".to_string(), 7, 1)]);
    let pool = open(dir);
    read_error(&pool, "vm", 7);
    pool.set_lost_reads_zeros(true);
    let mut all = vec![0u8; 64 * BS];
    pool.volume("vm")
        .and_then(|h| h.read_at(0, &mut all))
        .expect("read with lost blocks as zeros");
    assert!(all[7 * BS..8 * BS].iter().all(|&b| b == 0));
    assert!(all[8 * BS..9 * BS] == unique_block(6, 8)[..]);
    assert_eq!(pool.lost_blocks_read_as_zeros(), 1);
    // The lost block is no data for the statistics, and trim makes it a hole again.
    let h = pool.volume("vm").expect("volume");
    pool.set_lost_reads_zeros(false);
    h.zero_at(7 * BS as u64, BS as u64, true, false)
        .expect("trim");
    assert!(read_block(&pool, "vm", 7) == vec![0u8; BS]);
    verify_clean(&pool);
}

//! `condense repair` of a pool with delta compression (issue 44, crates/engine/src/repair/
//! deltas.rs): the rebuild keeps every delta a map names with its bases (found in the old
//! chunk table or by scanning the segments, a base only deltas name included), each base
//! holding a reference per delta, so verify is clean and GC frees no base; damage to a base
//! loses the blocks of every delta naming it, and the report names them all.

mod common;
use common::damage_record_of;
use condense_engine::repair::{self, RepairReport};
use condense_engine::{Compression, InitOptions, OpenOptions, Pool, UserKey};
use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;

const BS: usize = 4096;

/// Incompressible blocks (stored raw alone), one per seed.
fn noise(seed: u64) -> Vec<u8> {
    let mut rng = condense_engine::sim::SimRng::new(seed);
    (0..BS).map(|_| rng.next_u64() as u8).collect()
}

/// `blocks` noise blocks, and a near copy: each block with 16 bytes changed.
fn data(blocks: usize) -> (Vec<u8>, Vec<u8>) {
    let base: Vec<u8> = (0..blocks as u64).flat_map(noise).collect();
    let mut near = base.clone();
    for b in 0..blocks {
        near[b * BS + 1000..b * BS + 1016].copy_from_slice(&[b as u8 ^ 0x55; 16]);
    }
    (base, near)
}

fn open(dir: &Path, key: Option<&UserKey>) -> Arc<Pool> {
    let opts = OpenOptions {
        key: key.cloned(),
        ..Default::default()
    };
    Pool::open_path(dir, opts).expect("open")
}

/// A pool with delta compression on holding `base` and its near copy `near` (the copy's
/// blocks deltas of the base's); returns the number of deltas made.
fn delta_pool(dir: &Path, key: Option<&UserKey>, base: &[u8], near: &[u8]) -> u64 {
    let init = InitOptions {
        compression: Compression::Zstd(3),
        segment_bytes_target: 256 << 10,
        encryption: key.cloned(),
        ..Default::default()
    };
    Pool::init_path(dir, &init).expect("init");
    let pool = open(dir, key);
    pool.enable_deltas().expect("enable deltas");
    for (name, bytes) in [("base", base), ("near", near)] {
        pool.create_volume(name, bytes.len() as u64)
            .expect("create");
        let h = pool.volume(name).expect("volume");
        h.write_at(0, bytes, false).expect("write");
        pool.flush().expect("flush");
    }
    let deltas = pool.stats().expect("stats").delta.chunks_written;
    let blocks = (near.len() / BS) as u64;
    assert!(deltas >= blocks * 9 / 10, "{deltas} deltas of {blocks}");
    verify_clean(&pool, "before the damage");
    pool.close().expect("close");
    deltas
}

fn verify_clean(pool: &Pool, when: &str) {
    let r = pool.verify(&|_, _| {}).expect("verify");
    assert!(r.is_clean(), "verify {when}: {r:?}");
}

/// Every lost block the report names, as (volume, block).
fn lost(report: &RepairReport) -> BTreeSet<(String, u64)> {
    report
        .lost
        .iter()
        .flat_map(|l| (l.first_block..l.first_block + l.blocks).map(|b| (l.volume.clone(), b)))
        .collect()
}

/// Every block of `name` reads `bytes`, except `lost` ones, which fail ("was lost").
fn reads(pool: &Pool, name: &str, bytes: &[u8], lost: &BTreeSet<(String, u64)>) {
    let h = pool.volume(name).expect("volume");
    let mut buf = vec![0u8; BS];
    for b in 0..(bytes.len() / BS) as u64 {
        let r = h.read_at(b * BS as u64, &mut buf);
        if lost.contains(&(name.to_string(), b)) {
            let e = r.expect_err("a lost block fails to read").to_string();
            assert!(e.contains("was lost"), "{name} block {b}: {e}");
            continue;
        }
        r.unwrap_or_else(|e| panic!("{name} block {b}: {e}"));
        let at = b as usize * BS;
        assert!(
            buf[..] == bytes[at..at + BS],
            "{name} block {b} reads other data"
        );
    }
}

/// Chunk-table pages damaged, one of bases only deltas name (their volume deleted) and one of
/// deltas: the scan finds them all (bases named only by deltas the scan found, in a second
/// scan), nothing is lost, every block reads, verify is clean, and GC frees no base.
#[test]
fn damaged_chunk_table_pages_of_bases_and_deltas_are_rebuilt_from_the_segments() {
    chunk_table_case(None);
}

/// The same in an encrypted pool: a delta's record is opened with the pool's key to read its
/// bases, and the rebuilt metadata is sealed.
#[test]
fn encrypted_chunk_table_pages_of_bases_and_deltas_are_rebuilt() {
    chunk_table_case(Some(&UserKey::Key(zeroize::Zeroizing::new([9u8; 32]))));
}

fn chunk_table_case(key: Option<&UserKey>) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let (base, near) = data(300);
    let deltas = delta_pool(dir, key, &base, &near);
    // The base volume goes: its chunks (ids 0..300) live only as the deltas' bases.
    let pool = open(dir, key);
    pool.delete_volume("base").expect("delete");
    pool.gc(0).expect("gc");
    pool.close().expect("close");
    // Chunk-table pages 1 (ids 128..256: bases) and 3 (ids 384..512: deltas).
    let offsets: Vec<u64> = [200, 400]
        .iter()
        .map(|&id| {
            repair::chunk_page_offset(&pool, id)
                .expect("locate")
                .expect("a written page")
        })
        .collect();
    drop(pool);
    for at in offsets {
        let meta = dir.join("meta.dat");
        let mut m = std::fs::read(&meta).expect("read meta");
        m[at as usize + 8] ^= 0xff;
        std::fs::write(&meta, &m).expect("damage");
    }

    let dry = repair::repair(dir, true, key.cloned(), &|_, _| {}).expect("dry run");
    let report = repair::repair(dir, false, key.cloned(), &|_, _| {}).expect("repair");
    assert_eq!(report.lost, vec![], "{report:?}");
    assert_eq!(report.unreadable_chunk_pages, 2, "{report:?}");
    // The deltas of page 3 and every base of pages 1 (128 each, bar those not made deltas).
    assert!(report.chunks_from_segments >= 240, "{report:?}");
    assert_eq!(
        (dry.lost.clone(), dry.chunks_from_segments, dry.chunks_kept),
        (
            report.lost.clone(),
            report.chunks_from_segments,
            report.chunks_kept
        ),
        "the dry run says what the repair does"
    );

    let pool = open(dir, key);
    assert!(pool.deltas_enabled(), "the delta mode is kept");
    let s = pool.stats().expect("stats");
    assert_eq!(
        s.delta.chunks_written, deltas,
        "the count of deltas made is kept"
    );
    assert_eq!(s.unique_chunks, 600, "every base and delta is kept");
    reads(&pool, "near", &near, &BTreeSet::new());
    verify_clean(&pool, "after the repair");
    for _ in 0..2 {
        pool.gc(0).expect("gc");
    }
    assert_eq!(
        pool.stats().expect("stats").unique_chunks,
        600,
        "no base freed"
    );
    reads(&pool, "near", &near, &BTreeSet::new());
    verify_clean(&pool, "after GC");
}

/// A base's record damaged in its segment: the report names the base's block and the blocks
/// of every delta naming it (in a volume and its snapshot), as verify did, and only those;
/// the dry run says the same; afterwards verify is clean and every other block reads.
#[test]
fn damaged_base_record_loses_the_blocks_of_every_delta_naming_it() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let (base, near) = data(64);
    delta_pool(dir, None, &base, &near);
    let pool = open(dir, None);
    pool.create_snapshot("near", "s1").expect("snapshot");
    pool.close().expect("close");
    drop(pool);
    damage_record_of(dir, &base[7 * BS..8 * BS]);

    let named: BTreeSet<(String, u64)> = {
        let pool = open(dir, None);
        let v = pool.verify(&|_, _| {}).expect("verify");
        v.bad_blocks
            .iter()
            .flat_map(|(vol, bs)| bs.iter().map(move |&b| (vol.clone(), b)))
            .collect()
    };
    for vol in ["base", "near", "near@s1"] {
        assert!(named.contains(&(vol.into(), 7)), "{named:?}");
    }
    assert!(named.len() <= 6, "only the base's dependents: {named:?}");

    let dry = repair::repair(dir, true, None, &|_, _| {}).expect("dry run");
    assert_eq!(lost(&dry), named, "{dry:?}");
    let report = repair::repair(dir, false, None, &|_, _| {}).expect("repair");
    assert_eq!(lost(&report), named, "{report:?}");
    assert_eq!(
        report.lost, dry.lost,
        "the dry run says what the repair does"
    );
    let near_reason = report
        .lost
        .iter()
        .find(|l| l.volume == "near")
        .map(|l| l.reason.clone())
        .unwrap_or_default();
    assert!(
        near_reason.contains("is a delta whose base chunk"),
        "{report:?}"
    );

    let pool = open(dir, None);
    reads(&pool, "base", &base, &named);
    reads(&pool, "near", &near, &named);
    reads(&pool, "near@s1", &near, &named);
    verify_clean(&pool, "after the repair");
    // With the base volume gone, GC frees nothing a remaining delta names.
    pool.delete_volume("base").expect("delete");
    for _ in 0..2 {
        pool.gc(0).expect("gc");
    }
    reads(&pool, "near", &near, &named);
    verify_clean(&pool, "after GC");
    pool.close().expect("close");
    drop(pool);
    let again = repair::repair(dir, true, None, &|_, _| {}).expect("dry run");
    assert!(!again.found_damage(), "{again:?}");
}

/// Deltas whose bases the merge pass made forwards (a duplicate the sparse index let through
/// became a forward to the older copy): the rebuild keeps each such base id as a forward, so
/// the deltas read, verify is clean and GC frees nothing they need.
#[test]
fn bases_made_forwards_stay_forwards() {
    use condense_engine::index::{IndexSetting, SETTING_KEY};
    // 128 chunk-table pages of distinct blocks: more than the smallest sparse index's locality
    // cache holds, so most of a scrambled copy is stored again (crates/engine/tests/merge.rs).
    const N: usize = 16384;
    const NEAR: usize = 1024;
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let init = InitOptions {
        compression: Compression::Zstd(3),
        ..Default::default()
    };
    Pool::init_path(dir, &init).expect("init");
    let pool = open(dir, None);
    let setting = IndexSetting::Sparse { budget: 256 << 10 }.encode();
    pool.meta_put(SETTING_KEY, Some(&setting)).expect("sparse");
    pool.close().expect("close");
    drop(pool);
    let pool = open(dir, None);
    let (x, near) = data(N);
    // "a": the blocks in order; "b": the same scrambled, with deltas on, in writes of 8 blocks
    // (most are stored again: the sparse index misses them, its look-back reaching only the
    // write's own blocks; each enters the sketch index); "near": deltas of b's.
    let scrambled: Vec<u8> = (0..N)
        .flat_map(|b| x[(b * 7919 % N) * BS..][..BS].to_vec())
        .collect();
    let near: Vec<u8> = (0..NEAR)
        .flat_map(|b| near[(b * 7919 % N) * BS..][..BS].to_vec())
        .collect();
    for (name, bytes, deltas) in [
        ("a", &x, false),
        ("b", &scrambled, true),
        ("near", &near, true),
    ] {
        if deltas && !pool.deltas_enabled() {
            pool.enable_deltas().expect("enable deltas");
        }
        pool.create_volume(name, bytes.len() as u64)
            .expect("create");
        let h = pool.volume(name).expect("volume");
        let per = if name == "b" { 8 * BS } else { bytes.len() };
        for (i, piece) in bytes.chunks(per).enumerate() {
            h.write_at((i * per) as u64, piece, false).expect("write");
        }
        pool.flush().expect("flush");
    }
    let m = pool.merge_duplicates(1 << 20, &|_, _| {}).expect("merge");
    assert!(m.merged > 100, "{m:?}");
    let deltas = pool.stats().expect("stats").delta.chunks_written;
    assert!(deltas > NEAR as u64 / 2, "{deltas}");
    verify_clean(&pool, "after the merge pass");
    pool.close().expect("close");
    // A chunk-table page of deltas damaged (found again by scanning): a rebuild.
    let at = repair::chunk_page_offset(&pool, m.chunks_sorted + 300)
        .expect("locate")
        .expect("a written page");
    drop(pool);
    let meta = dir.join("meta.dat");
    let mut mb = std::fs::read(&meta).expect("read meta");
    mb[at as usize + 8] ^= 0xff;
    std::fs::write(&meta, &mb).expect("damage");

    let report = repair::repair(dir, false, None, &|_, _| {}).expect("repair");
    assert_eq!(report.lost, vec![], "{report:?}");
    let pool = open(dir, None);
    reads(&pool, "near", &near, &BTreeSet::new());
    reads(&pool, "b", &scrambled, &BTreeSet::new());
    verify_clean(&pool, "after the repair");
    pool.delete_volume("a").expect("delete");
    pool.delete_volume("b").expect("delete");
    for _ in 0..2 {
        pool.gc(0).expect("gc");
    }
    reads(&pool, "near", &near, &BTreeSet::new());
    verify_clean(&pool, "after GC");
}

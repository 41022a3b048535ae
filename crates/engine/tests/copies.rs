//! One damaged sector of a file the pool cannot open without loses nothing: each copy of the
//! superblock and of the checkpoint root, the journal's header and `meta.dat`'s header are
//! damaged in turn (bits flipped, a zeroed 4 KiB sector, the file deleted), in a plain and in
//! an encrypted pool whose journal holds flushed writes after its checkpoint. Each time the
//! pool opens read-only and writable, says what it worked around, reads back every block as
//! written, and after the writable open both copies agree again, verify is clean and a
//! reopen has nothing to say.

use condense_engine::{Compression, InitOptions, OpenOptions, Pool, UserKey, WritePolicy};
use std::path::{Path, PathBuf};
use std::sync::Arc;

const BS: usize = 4096;
const BLOCKS: u64 = 48;

fn key() -> UserKey {
    UserKey::Key(zeroize::Zeroizing::new([9u8; 32]))
}

fn open(dir: &Path, key: Option<&UserKey>, read_only: bool) -> Arc<Pool> {
    let opts = OpenOptions {
        key: key.cloned(),
        read_only,
        ..Default::default()
    };
    Pool::open_path(dir, opts).unwrap_or_else(|e| panic!("open (read_only {read_only}): {e}"))
}

fn block(seed: u64, b: u64) -> Vec<u8> {
    (0..BS / 8)
        .flat_map(|i| (seed << 40 ^ b << 16 ^ i as u64).to_le_bytes())
        .collect()
}

/// A pool whose checkpoint names blocks 0..32 (seed 1) and whose journal holds blocks
/// 16..48 (seed 2), flushed, then a crash. Returns what each block holds.
fn make_pool(dir: &Path, key: Option<&UserKey>) -> Vec<Vec<u8>> {
    let init = InitOptions {
        block_size: BS as u32,
        compression: Compression::Lz4,
        write_policy: WritePolicy::Async,
        segment_bytes_target: 1 << 20,
        metadata_cache_bytes: None,
        encryption: key.cloned(),
    };
    Pool::init_path(dir, &init).expect("init");
    let pool = open(dir, key, false);
    pool.create_volume("vm", BLOCKS * BS as u64)
        .expect("create");
    let data: Vec<u8> = (0..32).flat_map(|b| block(1, b)).collect();
    let h = pool.volume("vm").expect("vm");
    h.write_at(0, &data, false).expect("write");
    drop(h);
    pool.close().expect("close");
    drop(pool);
    let pool = open(dir, key, false);
    let data: Vec<u8> = (16..BLOCKS).flat_map(|b| block(2, b)).collect();
    let h = pool.volume("vm").expect("vm");
    h.write_at(16 * BS as u64, &data, false).expect("write");
    drop(h);
    pool.flush().expect("flush");
    drop(pool); // a crash: the journal holds the second write
    (0..BLOCKS)
        .map(|b| if b < 16 { block(1, b) } else { block(2, b) })
        .collect()
}

fn check_blocks(pool: &Pool, want: &[Vec<u8>], case: &str) {
    let h = pool.volume("vm").expect("vm");
    for (b, w) in want.iter().enumerate() {
        let mut buf = vec![0u8; BS];
        h.read_at(b as u64 * BS as u64, &mut buf)
            .unwrap_or_else(|e| panic!("{case}: reading block {b}: {e}"));
        assert!(&buf == w, "{case}: block {b} reads other data");
    }
}

fn journal(dir: &Path) -> PathBuf {
    std::fs::read_dir(dir)
        .expect("list")
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("journal-"))
        })
        .expect("a journal")
}

#[derive(Clone, Copy, Debug)]
enum Damage {
    /// Eight bits flipped in the first `n` bytes, from a seed.
    Flip(usize, u64),
    /// The first 4 KiB zeroed (the whole file where it is shorter).
    ZeroSector,
    /// The file cut to this many bytes.
    Cut(usize),
    Delete,
}

fn damage(path: &Path, how: Damage) {
    let mut bytes = std::fs::read(path).expect("read");
    match how {
        Damage::Flip(n, seed) => {
            let mut x = seed | 1;
            for _ in 0..8 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let at = (x % n.min(bytes.len()) as u64) as usize;
                bytes[at] ^= 1 << (x >> 32 & 7);
            }
        }
        Damage::ZeroSector => {
            let n = bytes.len().min(4096);
            bytes[..n].fill(0);
        }
        Damage::Cut(n) => bytes.truncate(n),
        Damage::Delete => {
            std::fs::remove_file(path).expect("remove");
            return;
        }
    }
    std::fs::write(path, bytes).expect("write");
}

fn same(dir: &Path, a: &str, b: &str) -> bool {
    std::fs::read(dir.join(a)).ok() == std::fs::read(dir.join(b)).ok()
}

fn case(key: Option<&UserKey>, file: &str, how: Damage) {
    let name = format!("{file} {how:?} (encrypted: {})", key.is_some());
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let want = make_pool(dir, key);
    let path = if file == "journal" {
        journal(dir)
    } else {
        dir.join(file)
    };
    let before = std::fs::read(&path).expect("read");
    damage(&path, how);
    assert_ne!(
        std::fs::read(&path).ok(),
        Some(before),
        "{name}: the damage changed nothing"
    );

    let pool = open(dir, key, true);
    let notes = pool.replay_report().notes.clone();
    assert!(!notes.is_empty(), "{name}: open said nothing of the damage");
    check_blocks(&pool, &want, &name);
    drop(pool);

    let pool = open(dir, key, false);
    assert_eq!(pool.replay_report().notes, notes, "{name}: writable open");
    check_blocks(&pool, &want, &name);
    let v = pool.verify(&|_, _| {}).expect("verify");
    assert!(
        v.is_clean(),
        "{name}: verify after the writable open: {v:?}"
    );
    drop(pool); // a crash again: the mend must not depend on a clean close

    assert!(
        same(dir, "superblock", "superblock.copy"),
        "{name}: superblock copies differ"
    );
    assert!(
        same(dir, "checkpoint", "checkpoint.copy"),
        "{name}: root copies differ"
    );
    let pool = open(dir, key, false);
    assert!(
        pool.replay_report().notes.is_empty(),
        "{name}: still damaged after a writable open: {:?}",
        pool.replay_report().notes
    );
    check_blocks(&pool, &want, &name);
    pool.close().expect("close");
}

#[test]
fn a_damaged_copy_of_the_superblock_or_root_loses_nothing() {
    let k = key();
    for key in [None, Some(&k)] {
        for file in [
            "superblock",
            "superblock.copy",
            "checkpoint",
            "checkpoint.copy",
        ] {
            for seed in [1, 2, 3] {
                case(key, file, Damage::Flip(4096, seed));
            }
            case(key, file, Damage::ZeroSector);
            case(key, file, Damage::Delete);
        }
    }
}

#[test]
fn a_damaged_journal_or_metadata_header_is_rebuilt() {
    let k = key();
    for key in [None, Some(&k)] {
        for seed in [1, 2, 3] {
            case(key, "journal", Damage::Flip(60, seed));
            case(key, "meta.dat", Damage::Flip(60, seed));
        }
        case(key, "meta.dat", Damage::ZeroSector);
    }
}

#[test]
fn both_copies_damaged_is_a_clear_error() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    make_pool(dir, None);
    damage(&dir.join("checkpoint"), Damage::ZeroSector);
    damage(&dir.join("checkpoint.copy"), Damage::ZeroSector);
    let e = Pool::open_path(dir, OpenOptions::default())
        .err()
        .expect("open fails");
    assert!(e.to_string().contains("checkpoint"), "{e}");
}

/// A journal whose header and batches are gone (a zeroed sector, a file cut short) is not a
/// crash: open refuses rather than dropping acknowledged writes silently; repair opens the
/// pool as of its last checkpoint and says the journal's writes are lost.
#[test]
fn a_journal_lost_with_its_header_is_refused_and_repair_says_so() {
    for how in [Damage::ZeroSector, Damage::Cut(10)] {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path();
        make_pool(dir, None);
        let path = journal(dir);
        assert!(std::fs::metadata(&path).expect("stat").len() < 4096);
        damage(&path, how);
        for read_only in [true, false] {
            let opts = OpenOptions {
                read_only,
                ..Default::default()
            };
            let e = Pool::open_path(dir, opts).err().expect("open refuses");
            assert!(e.to_string().contains("condense repair"), "{how:?}: {e}");
        }
        let report = condense_engine::repair::repair(dir, false, None, &|_, _| {}).expect("repair");
        assert!(
            report
                .notes
                .iter()
                .any(|n| n.contains("writes it held since the last checkpoint are lost")),
            "{how:?}: {report:?}"
        );
        let pool = open(dir, None, false);
        // As of the checkpoint: blocks 0..32 of the first write, nothing after.
        let want: Vec<Vec<u8>> = (0..BLOCKS)
            .map(|b| if b < 32 { block(1, b) } else { vec![0u8; BS] })
            .collect();
        check_blocks(&pool, &want, &format!("{how:?} after repair"));
        assert!(pool.verify(&|_, _| {}).expect("verify").is_clean());
    }
}

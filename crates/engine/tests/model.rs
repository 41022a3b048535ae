//! Model-based property test: random sequences of write / write_zeroes / trim / read / resize /
//! delete / snapshot / clone / rollback / snapshot delete / diff / close+reopen / gc across
//! several volumes, checked after every step against the plain in-memory model in
//! `condense_api::mem`.

use condense_api::mem::MemCatalog;
use condense_api::Catalog;
use condense_engine::io::Dir;
use condense_engine::sim::{SimDir, SimHandle};
use condense_engine::{
    CacheConf, CacheDir, CacheMode, Compression, InitOptions, OpenOptions, Pool, UserKey,
    WritePolicy,
};
use proptest::prelude::*;
use std::sync::Arc;

const BS: u64 = 4096;
const NAMES: [&str; 3] = ["a", "b", ".c"];
const SNAPS: [&str; 2] = ["s0", "s1"];

#[derive(Clone, Debug)]
enum Op {
    Create {
        v: usize,
        blocks: u64,
    },
    Delete {
        v: usize,
    },
    Write {
        v: usize,
        off: u64,
        len: u64,
        pattern: u8,
    },
    Zero {
        v: usize,
        off: u64,
        len: u64,
        unmap: bool,
    },
    Read {
        v: usize,
        off: u64,
        len: u64,
    },
    Status,
    Resize {
        v: usize,
        blocks: u64,
        force: bool,
    },
    Reopen,
    Gc,
    /// The merge pass (crates/engine/src/pool/merge.rs): no block changes.
    Merge,
    Flush,
    Snapshot {
        v: usize,
        s: usize,
    },
    DeleteSnapshot {
        v: usize,
        s: usize,
    },
    /// Clone volume `v` (or its snapshot `s`) into volume `to`.
    Clone {
        v: usize,
        s: Option<usize>,
        to: usize,
    },
    Rollback {
        v: usize,
        s: usize,
    },
    Diff {
        v: usize,
        s: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let v = 0..NAMES.len();
    prop_oneof![
        (v.clone(), 1..48u64).prop_map(|(v, blocks)| Op::Create { v, blocks }),
        v.clone().prop_map(|v| Op::Delete { v }),
        (v.clone(), 0..48 * BS, 1..6 * BS, 0..6u8).prop_map(|(v, off, len, pattern)| Op::Write {
            v,
            off,
            len,
            pattern
        }),
        (v.clone(), 0..48 * BS, 1..6 * BS, 0..6u8).prop_map(|(v, off, len, pattern)| Op::Write {
            v,
            off,
            len,
            pattern
        }),
        (v.clone(), 0..48 * BS, 1..6 * BS, 0..6u8).prop_map(|(v, off, len, pattern)| Op::Write {
            v,
            off,
            len,
            pattern
        }),
        (v.clone(), 0..48 * BS, 1..8 * BS, any::<bool>())
            .prop_map(|(v, off, len, unmap)| Op::Zero { v, off, len, unmap }),
        (v.clone(), 0..48 * BS, 1..8 * BS).prop_map(|(v, off, len)| Op::Read { v, off, len }),
        Just(Op::Status),
        (v, 1..48u64, any::<bool>()).prop_map(|(v, blocks, force)| Op::Resize { v, blocks, force }),
        Just(Op::Reopen),
        Just(Op::Gc),
        Just(Op::Merge),
        Just(Op::Flush),
        (0..NAMES.len(), 0..SNAPS.len()).prop_map(|(v, s)| Op::Snapshot { v, s }),
        (0..NAMES.len(), 0..SNAPS.len()).prop_map(|(v, s)| Op::Snapshot { v, s }),
        (0..NAMES.len(), 0..SNAPS.len()).prop_map(|(v, s)| Op::DeleteSnapshot { v, s }),
        (
            0..NAMES.len(),
            proptest::option::of(0..SNAPS.len()),
            0..NAMES.len()
        )
            .prop_map(|(v, s, to)| Op::Clone { v, s, to }),
        (0..NAMES.len(), 0..SNAPS.len()).prop_map(|(v, s)| Op::Rollback { v, s }),
        (0..NAMES.len(), 0..SNAPS.len()).prop_map(|(v, s)| Op::Diff { v, s }),
    ]
}

std::thread_local! {
    /// Set by the deltas variant (each test runs on its own thread): similar blocks.
    static SIMILAR: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Block content from a pattern: few patterns, so blocks deduplicate; pattern 0 is zeros.
/// In the deltas variant every block is one noise block with the pattern in 8 bytes of each
/// 512: blocks of different patterns are near copies (deltas of each other).
fn data(pattern: u8, off: u64, len: u64) -> Vec<u8> {
    let similar = SIMILAR.with(|s| s.get());
    (off..off + len)
        .map(|i| {
            if pattern == 0 {
                0
            } else if similar {
                let j = i % BS;
                let mut z = j.wrapping_mul(0x9E37_79B9_7F4A_7C15);
                z = (z ^ (z >> 31)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                let noise = (z ^ (z >> 29)) as u8;
                if j % 512 < 8 {
                    noise ^ pattern
                } else {
                    noise
                }
            } else {
                ((i / 512 % 7) as u8 * 31) ^ pattern
            }
        })
        .collect()
}

fn same_outcome<A, B>(
    what: &str,
    a: &Result<A, condense_api::VolumeError>,
    b: &Result<B, condense_api::VolumeError>,
) {
    assert_eq!(
        a.is_ok(),
        b.is_ok(),
        "{what}: engine {:?} vs model {:?}",
        a.as_ref().err(),
        b.as_ref().err()
    );
}

fn open(dir: &Arc<SimDir>, key: &Option<UserKey>, cache: &Option<Arc<SimDir>>) -> Arc<Pool> {
    let opts = OpenOptions {
        key: key.clone(),
        cache_dir: cache
            .as_ref()
            .map(|c| CacheDir(Arc::new(SimHandle(c.clone())))),
        journal_bytes_max: 64 << 10,
        journal_buffer_bytes: 4096,
        // A cache of a few pages: every operation evicts and reloads metadata pages.
        metadata_cache_bytes: Some(2 * 4096),
        // Destaged at the flushes below instead, so that every run replays exactly.
        destage_in_background: false,
        // Deleted maps stay pending (verify and the figures count them as such).
        release_in_background: false,
        ..Default::default()
    };
    match Pool::open(Arc::new(SimHandle(dir.clone())), opts) {
        Ok(p) => p,
        Err(e) => panic!("reopen failed: {e}"),
    }
}

fn check_all(pool: &Pool, model: &MemCatalog) {
    let names: Vec<String> = model
        .list()
        .map(|l| l.into_iter().map(|v| v.name).collect())
        .unwrap_or_default();
    let mut engine_names: Vec<String> = pool.volumes().into_iter().map(|(n, _)| n).collect();
    engine_names.sort();
    assert_eq!(engine_names, names);
    let snaps: Vec<String> = model
        .snapshots()
        .map(|l| l.into_iter().map(|s| s.full_name()).collect())
        .unwrap_or_default();
    let engine_snaps: Vec<String> = Catalog::snapshots(pool)
        .map(|l| l.into_iter().map(|s| s.full_name()).collect())
        .unwrap_or_default();
    assert_eq!(engine_snaps, snaps, "snapshots");
    for n in names.into_iter().chain(snaps) {
        let (Ok(e), Ok(m)) = (Catalog::open(pool, &n), model.open(&n)) else {
            panic!("open {n}")
        };
        assert_eq!(e.size(), m.size(), "size of {n}");
        let mut a = vec![0u8; e.size() as usize];
        let mut b = vec![0u8; m.size() as usize];
        assert!(e.read(0, &mut a).is_ok());
        assert!(m.read(0, &mut b).is_ok());
        assert!(a == b, "content of {n} differs");
        let (Ok(x), Ok(y)) = (e.block_status(0, e.size()), m.block_status(0, m.size())) else {
            panic!("status")
        };
        assert_eq!(x, y, "extents of {n}");
    }
}

/// A cache of 24 slots (in its own simulated directory): most reads evict.
const TINY_CACHE_BYTES: u64 = 4096 + 24 * 4224;

fn run(ops: Vec<Op>, compression: Compression, key: Option<UserKey>, mode: Option<CacheMode>) {
    run_with(ops, compression, key, mode, false, false)
}

/// [`run`], with the sparse dedup index at its smallest budget if `sparse`, and delta
/// compression on (and similar blocks) if `deltas`.
fn run_with(
    ops: Vec<Op>,
    compression: Compression,
    key: Option<UserKey>,
    mode: Option<CacheMode>,
    sparse: bool,
    deltas: bool,
) {
    SIMILAR.with(|s| s.set(deltas));
    let disk = SimDir::new();
    let cache = mode.map(|_| SimDir::new());
    let init = InitOptions {
        block_size: BS as u32,
        compression,
        write_policy: WritePolicy::Async,
        segment_bytes_target: 1 << 16,
        metadata_cache_bytes: None,
        encryption: key.clone(),
    };
    if let Err(e) = Pool::init(&SimHandle(disk.clone()), &init) {
        panic!("init: {e}");
    }
    let mut pool = open(&disk, &key, &cache);
    if sparse {
        let setting = condense_engine::index::IndexSetting::Sparse {
            budget: condense_engine::sparse_index::MIN_BUDGET,
        };
        let key_name = condense_engine::index::SETTING_KEY;
        assert!(pool.meta_put(key_name, Some(&setting.encode())).is_ok());
        assert!(pool.close().is_ok());
        drop(pool);
        pool = open(&disk, &key, &cache);
    }
    if deltas {
        if let Err(e) = pool.enable_deltas() {
            panic!("enable deltas: {e}");
        }
    }
    if let Some(c) = &cache {
        let conf = CacheConf {
            path: "sim-cache".into(),
            size_bytes: TINY_CACHE_BYTES,
            mode: mode.unwrap_or(CacheMode::WriteThrough),
        };
        if let Err(e) = pool.attach_cache(Arc::new(SimHandle(c.clone())), conf) {
            panic!("attach cache: {e}");
        }
    }
    let model = MemCatalog::new(BS as u32);
    // Start with every volume present, so most operations act on data.
    for (i, name) in NAMES.iter().enumerate() {
        let size = (48 - 16 * i as u64) * BS;
        assert!(Catalog::create(&*pool, name, size).is_ok() && model.create(name, size).is_ok());
    }
    for op in ops {
        match op.clone() {
            Op::Create { v, blocks } => {
                let a = Catalog::create(&*pool, NAMES[v], blocks * BS);
                let b = model.create(NAMES[v], blocks * BS);
                same_outcome("create", &a, &b);
            }
            Op::Delete { v } => {
                let a = Catalog::delete(&*pool, NAMES[v]);
                let b = model.delete(NAMES[v]);
                same_outcome("delete", &a, &b);
            }
            Op::Write {
                v,
                off,
                len,
                pattern,
            } => {
                if let (Ok(e), Ok(m)) = (Catalog::open(&*pool, NAMES[v]), model.open(NAMES[v])) {
                    let d = data(pattern, off, len);
                    let a = e.write(off, &d, false);
                    let b = m.write(off, &d, false);
                    same_outcome("write", &a, &b);
                }
            }
            Op::Zero { v, off, len, unmap } => {
                if let (Ok(e), Ok(m)) = (Catalog::open(&*pool, NAMES[v]), model.open(NAMES[v])) {
                    let a = e.write_zeroes(off, len, unmap, false);
                    let b = m.write_zeroes(off, len, unmap, false);
                    same_outcome("write_zeroes", &a, &b);
                }
            }
            Op::Read { v, off, len } => {
                if let (Ok(e), Ok(m)) = (Catalog::open(&*pool, NAMES[v]), model.open(NAMES[v])) {
                    let mut a = vec![1u8; len as usize];
                    let mut b = vec![2u8; len as usize];
                    let ra = e.read(off, &mut a);
                    let rb = m.read(off, &mut b);
                    same_outcome("read", &ra, &rb);
                    if ra.is_ok() {
                        assert!(a == b, "read {off}+{len} differs");
                    }
                }
            }
            Op::Status => check_all(&pool, &model),
            Op::Resize { v, blocks, force } => {
                let a = Catalog::resize(&*pool, NAMES[v], blocks * BS, force);
                let b = model.resize(NAMES[v], blocks * BS, force);
                same_outcome("resize", &a, &b);
            }
            Op::Reopen => {
                assert!(pool.close().is_ok());
                drop(pool);
                pool = open(&disk, &key, &cache);
            }
            Op::Gc => {
                if let Err(e) = pool.gc(1) {
                    panic!("gc: {e}");
                }
            }
            Op::Merge => {
                if let Err(e) = pool.merge_duplicates(1 << 16, &|_, _| {}) {
                    panic!("merge: {e}");
                }
                check_all(&pool, &model);
            }
            Op::Flush => {
                assert!(pool.flush().is_ok());
                // A writeback cache destages a sealed segment (a no-op without one).
                if let Err(e) = pool.destage_one() {
                    panic!("destage: {e}");
                }
            }
            Op::Snapshot { v, s } => {
                let a = Catalog::snapshot_create(&*pool, NAMES[v], SNAPS[s]);
                let b = model.snapshot_create(NAMES[v], SNAPS[s]);
                same_outcome("snapshot create", &a, &b);
            }
            Op::DeleteSnapshot { v, s } => {
                let a = Catalog::snapshot_delete(&*pool, NAMES[v], SNAPS[s]);
                let b = model.snapshot_delete(NAMES[v], SNAPS[s]);
                same_outcome("snapshot delete", &a, &b);
            }
            Op::Clone { v, s, to } => {
                let src = match s {
                    Some(s) => format!("{}@{}", NAMES[v], SNAPS[s]),
                    None => NAMES[v].to_string(),
                };
                let a = Catalog::clone_volume(&*pool, &src, NAMES[to]);
                let b = model.clone_volume(&src, NAMES[to]);
                same_outcome("clone", &a, &b);
            }
            Op::Rollback { v, s } => {
                let a = Catalog::rollback(&*pool, NAMES[v], SNAPS[s], false);
                let b = model.rollback(NAMES[v], SNAPS[s], false);
                same_outcome("rollback", &a, &b);
            }
            Op::Diff { v, s } => {
                let from = format!("{}@{}", NAMES[v], SNAPS[s]);
                if let (Ok(a), Ok(b)) =
                    (pool.volume_size_any(&from), pool.volume_size_any(NAMES[v]))
                {
                    let len = a.max(b);
                    let x = Catalog::diff(&*pool, &from, NAMES[v], 0, len);
                    let y = model.diff(&from, NAMES[v], 0, len);
                    match (x, y) {
                        (Ok(x), Ok(y)) => assert_eq!(x, y, "diff {from} {}", NAMES[v]),
                        (x, y) => panic!("diff: engine {x:?} vs model {y:?}"),
                    }
                }
            }
        }
        // The per-volume figures kept through the change equal a count from scratch, and
        // exclusive + shared is every live chunk (docs/STATS.md).
        if let Err(e) = pool.check_attribution() {
            panic!("space attribution after {op:?}: {e}");
        }
    }
    check_all(&pool, &model);
    // Everything written survives a reopen, and verify finds nothing wrong.
    assert!(pool.close().is_ok());
    drop(pool);
    let pool = open(&disk, &key, &cache);
    check_all(&pool, &model);
    match pool.verify(&|_, _| {}) {
        Ok(r) => assert!(r.is_clean(), "verify: {r:?}"),
        Err(e) => panic!("verify: {e}"),
    }
    let stats = match pool.stats() {
        Ok(s) => s,
        Err(e) => panic!("stats: {e}"),
    };
    let sim = SimHandle(disk.clone());
    // A writeback cache's segments and journal are part of the pool.
    let in_cache: u64 = cache.as_ref().map_or(0, |c| {
        let h = SimHandle(c.clone());
        [h.list("seg-"), h.list("journal-")]
            .into_iter()
            .flat_map(|n| n.unwrap_or_default())
            .filter_map(|n| c.file_len(&n))
            .sum()
    });
    assert_eq!(
        stats.physical_bytes,
        sim.total_bytes().unwrap_or(0) + in_cache
    );
    if mode == Some(CacheMode::WriteBack) {
        // Detaching destages everything; the pool then needs nothing from the cache directory.
        if let Err(e) = pool.detach_cache(false) {
            panic!("detach: {e}");
        }
        assert!(pool.close().is_ok());
        drop(pool);
        let pool = open(&disk, &key, &None);
        check_all(&pool, &model);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    #[test]
    fn engine_matches_model_lz4(ops in proptest::collection::vec(op(), 1..120)) {
        run(ops, Compression::Lz4, None, None);
    }

    #[test]
    fn engine_matches_model_zstd(ops in proptest::collection::vec(op(), 1..60)) {
        run(ops, Compression::Zstd(3), None, None);
    }

    /// zstd's fast levels (negative), which write the same codec.
    #[test]
    fn engine_matches_model_zstd_fast(ops in proptest::collection::vec(op(), 1..60)) {
        run(ops, Compression::Zstd(-1), None, None);
    }

    /// The LZ4 run with the sparse dedup index (smallest budget) and its merge pass.
    #[test]
    fn engine_matches_model_sparse(ops in proptest::collection::vec(op(), 1..120)) {
        run_with(ops, Compression::Lz4, None, None, true, false);
    }

    /// Delta compression on, with similar blocks, the sparse index and its merge pass (which
    /// leaves deltas alone), on an encrypted pool.
    #[test]
    fn engine_matches_model_deltas(ops in proptest::collection::vec(op(), 1..120)) {
        run_with(ops, Compression::Lz4, Some(UserKey::key([0xa5; 32])), None, true, true);
    }

    /// The LZ4 run on an encrypted pool.
    #[test]
    fn engine_matches_model_encrypted(ops in proptest::collection::vec(op(), 1..120)) {
        run(ops, Compression::Lz4, Some(UserKey::key([0xa5; 32])), None);
    }

    /// The LZ4 run with a tiny cache tier attached (in its own simulated directory): reads
    /// go through it, reopens find it warm, GC moves records under it.
    #[test]
    fn engine_matches_model_cached(ops in proptest::collection::vec(op(), 1..120)) {
        run(ops, Compression::Lz4, None, Some(CacheMode::WriteThrough));
    }

    /// The cached run on an encrypted pool (the cache holds sealed records).
    #[test]
    fn engine_matches_model_cached_encrypted(ops in proptest::collection::vec(op(), 1..120)) {
        run(ops, Compression::Lz4, Some(UserKey::key([0xa5; 32])), Some(CacheMode::WriteThrough));
    }

    /// A writeback cache: segments and the journal staged in the cache directory, one sealed
    /// segment destaged at each flush; at the end a detach destages the rest.
    #[test]
    fn engine_matches_model_writeback(ops in proptest::collection::vec(op(), 1..120)) {
        run(ops, Compression::Lz4, None, Some(CacheMode::WriteBack));
    }
}

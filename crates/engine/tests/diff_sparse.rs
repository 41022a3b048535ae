//! `diff` of huge sparse volumes (issue 23): it used to walk the logical size leaf window by
//! leaf window, so a 1 EiB volume with 1 MiB written took minutes. It now walks only the
//! leaves the two block maps hold, in bounded steps. These tests pin the answer (exact runs,
//! across many steps and across subtrees far apart) and that a step makes progress and stops
//! early when the maps hold more leaves than one step looks at.

use condense_api::Change;
use condense_engine::sim::{SimDir, SimHandle};
use condense_engine::{Compression, InitOptions, OpenOptions, Pool, WritePolicy};
use std::collections::BTreeSet;
use std::sync::Arc;

const BS: u64 = 4096;
/// Blocks per block-map leaf.
const PER: u64 = 512;
const EIB: u64 = 1 << 60;

fn pool() -> Arc<Pool> {
    let disk = SimDir::new();
    let init = InitOptions {
        block_size: BS as u32,
        compression: Compression::None,
        write_policy: WritePolicy::Async,
        segment_bytes_target: 1 << 20,
        metadata_cache_bytes: None,
        encryption: None,
    };
    if let Err(e) = Pool::init(&SimHandle(disk.clone()), &init) {
        panic!("init: {e}");
    }
    match Pool::open(Arc::new(SimHandle(disk)), OpenOptions::default()) {
        Ok(p) => p,
        Err(e) => panic!("open: {e}"),
    }
}

fn block(seed: u64, b: u64) -> Vec<u8> {
    (0..BS / 8)
        .flat_map(|i| (seed << 48 ^ b << 12 ^ i).to_le_bytes())
        .collect()
}

fn write(pool: &Pool, vol: &str, seed: u64, b: u64) {
    let h = pool.volume(vol).expect("volume");
    h.write_at(b * BS, &block(seed, b), false).expect("write");
}

/// Blocks spread over the whole EiB: leaves far apart (different subtrees at every level)
/// and some neighbours.
fn spread(n: u64) -> Vec<u64> {
    let blocks = EIB / BS;
    (0..n)
        .map(|i| (i * (blocks / n) + i * 7) % blocks)
        .chain([0, 1, PER - 1, PER, blocks - 1])
        .collect()
}

/// Every run covers the range in order, and the changed blocks are exactly `want`.
fn check_runs(runs: &[Change], offset: u64, len: u64, want: &BTreeSet<u64>) {
    let mut at = offset;
    let mut got = BTreeSet::new();
    for r in runs {
        assert_eq!(r.offset, at, "runs are contiguous: {runs:?}");
        assert!(r.len > 0);
        if r.changed {
            assert_eq!(r.offset % BS, 0);
            assert_eq!(r.len % BS, 0);
            // A run is small here (a few blocks): list them.
            assert!(r.len <= 64 * BS, "changed run too long: {r:?}");
            for b in r.offset / BS..(r.offset + r.len) / BS {
                got.insert(b);
            }
        }
        at += r.len;
    }
    assert_eq!(at, offset + len, "runs cover the range");
    assert_eq!(&got, want);
}

#[test]
fn a_sparse_exbibyte_volume_diffs_by_what_it_holds() {
    let pool = pool();
    pool.create_volume("big", EIB).expect("create 1 EiB");
    let before = spread(600);
    for &b in &before {
        write(&pool, "big", 1, b);
    }
    pool.create_snapshot("big", "s").expect("snapshot");
    let mut want = BTreeSet::new();
    // New data in leaves the snapshot has, and in leaves it has not.
    for &b in before.iter().step_by(3) {
        write(&pool, "big", 2, b);
        want.insert(b);
    }
    for &b in &spread(400) {
        let b = (b + 3 * PER) % (EIB / BS);
        write(&pool, "big", 3, b);
        want.insert(b);
    }
    // The same bytes again: the same chunk, not a change.
    write(&pool, "big", 1, before[1]);
    // A trim of a block that held data is a change.
    let gone = before[2];
    pool.volume("big")
        .and_then(|h| h.zero_at(gone * BS, BS, true, false))
        .expect("trim");
    want.insert(gone);
    want.remove(&before[1]);

    let runs = pool.diff_bytes("big@s", "big", 0, EIB).expect("diff");
    check_runs(&runs, 0, EIB, &want);
    // The same answer once everything is stored (pages shared on disk, none dirty).
    pool.flush().expect("flush");
    let runs = pool.diff_bytes("big@s", "big", 0, EIB).expect("diff");
    check_runs(&runs, 0, EIB, &want);
    // And over an unaligned window in the middle.
    let (off, len) = (EIB / 3 + 1234, EIB / 4 + 77);
    let inside: BTreeSet<u64> = want
        .iter()
        .copied()
        .filter(|&b| b * BS + BS > off && b * BS < off + len)
        .collect();
    let runs = pool.diff_bytes("big@s", "big", off, len).expect("diff");
    let mut at = off;
    let mut got = BTreeSet::new();
    for r in &runs {
        assert_eq!(r.offset, at);
        if r.changed {
            for b in r.offset / BS..(r.offset + r.len).div_ceil(BS) {
                got.insert(b);
            }
        }
        at += r.len;
    }
    assert_eq!(at, off + len);
    assert_eq!(got, inside);
}

#[test]
fn a_step_stops_after_a_bounded_number_of_leaves_and_always_progresses() {
    let pool = pool();
    pool.create_volume("v", EIB).expect("create");
    let n = 3 * condense_engine::snapshot::DIFF_STEP_LEAVES as u64;
    for i in 0..n {
        write(&pool, "v", 1, i * 1000 * PER);
    }
    pool.create_snapshot("v", "s").expect("snapshot");
    for i in 0..n {
        write(&pool, "v", 2, i * 1000 * PER + 1);
    }
    let (mut at, mut steps) = (0u64, 0);
    let mut changed = 0u64;
    while at < EIB {
        let (runs, next) = pool.diff_step("v@s", "v", at, EIB - at).expect("step");
        assert!(next > at, "a step progresses");
        assert_eq!(runs.first().map(|r| r.offset), Some(at));
        assert_eq!(runs.iter().map(|r| r.len).sum::<u64>(), next - at);
        changed += runs
            .iter()
            .filter(|r| r.changed)
            .map(|r| r.len)
            .sum::<u64>();
        at = next;
        steps += 1;
    }
    assert_eq!(changed, n * BS);
    assert!((3..=5).contains(&steps), "{steps} steps for {n} leaves");
}

//! Snapshots and clones at the engine: space accounting and checks on a live pool.
//! (Content against a model: model.rs; crash points: crash_sim.rs.)

use condense_engine::sim::{SimDir, SimHandle};
use condense_engine::{Compression, InitOptions, OpenOptions, Pool, WritePolicy};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

const BS: usize = 4096;

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

/// A block no other call makes: `seed` and the block number in every 8 bytes.
fn unique_block(seed: u64, block: u64) -> Vec<u8> {
    (0..BS / 8)
        .flat_map(|i| (seed << 40 ^ block << 16 ^ i as u64).to_le_bytes())
        .collect()
}

fn write_unique(pool: &Pool, vol: &str, seed: u64, first: u64, count: u64) {
    let h = pool.volume(vol).expect("volume");
    let data: Vec<u8> = (first..first + count)
        .flat_map(|b| unique_block(seed, b))
        .collect();
    h.write_at(first * BS as u64, &data, false).expect("write");
}

fn read_block(pool: &Pool, vol: &str, block: u64) -> Vec<u8> {
    let mut buf = vec![0u8; BS];
    pool.volume(vol)
        .and_then(|h| h.read_at(block * BS as u64, &mut buf))
        .expect("read");
    buf
}

#[test]
fn freeable_bytes_are_exactly_what_deleting_the_snapshot_frees() {
    let pool = pool();
    pool.create_volume("vm", 4096 * BS as u64).expect("create");
    write_unique(&pool, "vm", 1, 0, 2048);
    pool.create_snapshot("vm", "before").expect("snapshot");
    // Freshly taken, it holds nothing of its own.
    assert_eq!(
        pool.snapshot_freeable_bytes("vm", "before")
            .expect("freeable"),
        0
    );
    // Overwrite the first 1000 blocks: the snapshot alone now holds their old chunks.
    write_unique(&pool, "vm", 2, 0, 1000);
    pool.flush().expect("flush");
    let freeable = pool
        .snapshot_freeable_bytes("vm", "before")
        .expect("freeable");
    let record = (BS + 32) as u64; // uncompressed record: header + block
    let chunks_only = 1000 * record;
    assert!(
        freeable >= chunks_only && freeable < chunks_only + (1 << 20),
        "freeable {freeable}, chunks alone {chunks_only}"
    );
    // Shares of volumes and snapshots add up to the live chunk bytes.
    let s = pool.stats().expect("stats");
    let shares: u64 = s
        .volumes
        .iter()
        .chain(&s.snapshots)
        .map(|v| v.physical_bytes)
        .sum();
    let live = s.stored_bytes + s.unique_chunks * 32;
    assert!(shares.abs_diff(live) <= 2, "shares {shares} vs live {live}");
    assert_eq!(s.snapshots.len(), 1);
    assert_eq!(s.snapshots[0].snapshot_of.as_deref(), Some("vm"));
    // Deleting it frees those chunks: GC reclaims what snapshot list promised.
    let before = pool.stats().expect("stats");
    pool.delete_snapshot("vm", "before").expect("delete");
    // Its map is released in the background; waited for here.
    pool.finish_releases(&|_, _| {}).expect("release");
    let after = pool.stats().expect("stats");
    let freed_chunk_bytes = (before.stored_bytes + before.unique_chunks * 32)
        - (after.stored_bytes + after.unique_chunks * 32);
    assert_eq!(freed_chunk_bytes, chunks_only);
    let r = pool.verify(&|_, _| {}).expect("verify");
    assert!(r.is_clean(), "{r:?}");
}

#[test]
fn hundred_clones_share_one_copy() {
    let pool = pool();
    pool.create_volume("golden", 2048 * BS as u64)
        .expect("create");
    write_unique(&pool, "golden", 3, 0, 2048);
    pool.create_snapshot("golden", "v1").expect("snapshot");
    let unique = pool.stats().expect("stats").unique_chunks;
    for i in 0..100 {
        pool.clone_volume("golden@v1", &format!("vm{i}"))
            .expect("clone");
    }
    let s = pool.stats().expect("stats");
    assert_eq!(s.unique_chunks, unique, "clones copied chunks");
    // Each clone diverges on its own block; the others and the golden image do not see it.
    for i in 0..100u64 {
        write_unique(&pool, &format!("vm{i}"), 100 + i, i, 1);
    }
    for i in [0u64, 57, 99] {
        assert_eq!(
            read_block(&pool, &format!("vm{i}"), i),
            unique_block(100 + i, i)
        );
        assert_eq!(read_block(&pool, "golden@v1", i), unique_block(3, i));
        let other = format!("vm{}", (i + 1) % 100);
        assert_eq!(read_block(&pool, &other, i), unique_block(3, i));
    }
    let r = pool.verify(&|_, _| {}).expect("verify");
    assert!(r.is_clean(), "{r:?}");
    assert!(pool
        .volume("golden@v1")
        .expect("open")
        .write_at(0, &[1u8; BS], false)
        .is_err());
}

/// `verify` through the control socket runs while VMs write: it must not report damage
/// that is only writes landing between its passes.
#[test]
fn verify_on_a_live_pool_reports_no_false_damage() {
    let pool = pool();
    pool.create_volume("busy", 1024 * BS as u64)
        .expect("create");
    write_unique(&pool, "busy", 4, 0, 1024);
    pool.create_snapshot("busy", "s").expect("snapshot");
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (pool, stop) = (pool.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut seed = 10;
            while !stop.load(Ordering::Relaxed) {
                seed += 1;
                write_unique(&pool, "busy", seed, (seed * 37) % 1000, 16);
            }
        })
    };
    for _ in 0..5 {
        let r = pool.verify(&|_, _| {}).expect("verify");
        assert!(r.is_clean(), "verify while writing: {r:?}");
    }
    stop.store(true, Ordering::Relaxed);
    writer.join().expect("writer");
    let r = pool.verify(&|_, _| {}).expect("verify");
    assert!(r.is_clean(), "{r:?}");
}

//! Delta compression (issue 44, crates/engine/src/pool/delta.rs) through a pool on the
//! simulated directory: similar blocks become deltas, every block reads back exactly, verify
//! is clean (a delta's references on its bases counted), a base outlives the volume that
//! wrote it while a delta names it, a dead delta's GC drops its references, and a reopen and
//! a crash keep all of it.

use condense_engine::sim::{SimDir, SimHandle, SimRng};
use condense_engine::{Compression, InitOptions, OpenOptions, Pool};
use std::sync::Arc;

const BS: usize = 4096;
const BLOCKS: usize = 64;

/// Incompressible blocks (stored raw alone), one per index.
fn noise(seed: u64) -> Vec<u8> {
    let mut rng = SimRng::new(seed);
    (0..BS).map(|_| rng.next_u64() as u8).collect()
}

/// The base volume's data, and a near copy: each block with 16 bytes changed.
fn data() -> (Vec<u8>, Vec<u8>) {
    let base: Vec<u8> = (0..BLOCKS as u64).flat_map(noise).collect();
    let mut near = base.clone();
    for b in 0..BLOCKS {
        near[b * BS + 1000..b * BS + 1016].copy_from_slice(&[b as u8; 16]);
    }
    (base, near)
}

fn open(disk: &Arc<SimDir>) -> Arc<Pool> {
    let opts = OpenOptions {
        destage_in_background: false,
        release_in_background: false,
        ..Default::default()
    };
    Pool::open(Arc::new(SimHandle(disk.clone())), opts).expect("open")
}

fn write(pool: &Pool, name: &str, bytes: &[u8]) {
    pool.create_volume(name, bytes.len() as u64)
        .expect("create");
    let h = pool.volume(name).expect("volume");
    h.write_at(0, bytes, false).expect("write");
    pool.flush().expect("flush");
}

fn reads(pool: &Pool, name: &str, bytes: &[u8]) {
    let h = pool.volume(name).expect("volume");
    let mut buf = vec![0u8; bytes.len()];
    h.read_at(0, &mut buf).expect("read");
    for b in 0..bytes.len() / BS {
        assert!(
            buf[b * BS..(b + 1) * BS] == bytes[b * BS..(b + 1) * BS],
            "{name} block {b} reads other data"
        );
    }
}

fn verify_clean(pool: &Pool, when: &str) {
    let r = pool.verify(&|_, _| {}).expect("verify");
    assert!(r.is_clean(), "verify {when}: {r:?}");
    assert!(r.not_checked.is_empty(), "{when}: {:?}", r.not_checked);
}

fn unique(pool: &Pool) -> u64 {
    pool.stats().expect("stats").unique_chunks
}

#[test]
fn similar_blocks_become_deltas_whose_bases_live_while_named() {
    let (base, near) = data();
    let disk = SimDir::new();
    let init = InitOptions {
        compression: Compression::Zstd(3),
        segment_bytes_target: 64 << 10,
        ..Default::default()
    };
    Pool::init(&SimHandle(disk.clone()), &init).expect("init");
    let pool = open(&disk);
    pool.enable_deltas().expect("enable deltas");
    assert!(pool.deltas_enabled());
    write(&pool, "base", &base);
    write(&pool, "near", &near);
    let d = pool.delta_stats();
    assert!(d.deltas >= BLOCKS as u64 * 9 / 10, "{d:?}");
    assert!(d.saved_bytes >= d.deltas * 3 * BS as u64 / 4, "{d:?}");
    assert!(d.sketch_ram_bytes > 0);
    assert_eq!(unique(&pool), 2 * BLOCKS as u64);
    reads(&pool, "base", &base);
    reads(&pool, "near", &near);
    verify_clean(&pool, "after the writes");

    // Reopen: deltas read (the sketch index is rebuilt from nothing).
    pool.close().expect("close");
    let pool = open(&disk);
    reads(&pool, "near", &near);
    verify_clean(&pool, "after a reopen");

    // The base volume deleted, GC: the bases stay (the deltas name them).
    pool.delete_volume("base").expect("delete");
    pool.gc(0).expect("gc");
    pool.gc(0).expect("gc again");
    assert_eq!(unique(&pool), 2 * BLOCKS as u64, "bases kept while named");
    reads(&pool, "near", &near);
    verify_clean(&pool, "after the base volume's delete and GC");

    // A crash after a flush keeps it all.
    pool.flush().expect("flush");
    let crashed = disk.crash(&mut SimRng::new(44));
    drop(pool);
    let pool = open(&crashed);
    reads(&pool, "near", &near);
    verify_clean(&pool, "after a crash");

    // The deltas overwritten: GC drops them (DropDelta), then their bases.
    let h = pool.volume("near").expect("volume");
    h.write_at(
        0,
        &(0..BLOCKS as u64)
            .flat_map(|s| noise(1000 + s))
            .collect::<Vec<u8>>(),
        false,
    )
    .expect("overwrite");
    pool.flush().expect("flush");
    for _ in 0..3 {
        pool.gc(0).expect("gc");
    }
    verify_clean(&pool, "after the deltas' GC");
    assert_eq!(
        unique(&pool),
        BLOCKS as u64,
        "the deltas and their bases are gone"
    );
    pool.close().expect("close");
    let pool = open(&crashed);
    verify_clean(&pool, "after the last reopen");
}

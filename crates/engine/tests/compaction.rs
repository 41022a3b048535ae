//! Compaction of `meta.dat` at close (crates/meta/src/page_cache/compaction.rs) under
//! crashes: a close that compacts, stopped at seeded I/O calls (so the disk fails from there
//! on) and then crashed (unsynced writes lost, kept or torn by the seed), reopens to a pool
//! that verifies clean and reads every block of both volumes.
//!
//! The pool: volume `a` of 128 Ki unique blocks (checkpointed), then volume `b` with the
//! same content, flushed but not checkpointed, so the close's checkpoint rewrites every
//! chunk-table leaf (each chunk gains a reference) and leaves their old copies free below
//! the new ones: a close that compacts. `CONDENSE_COMPACTION_SEEDS=N` sets how many crash
//! points run (default 12).

use condense_engine::sim::{SimDir, SimHandle, SimRng};
use condense_engine::{Compression, InitOptions, OpenOptions, Pool, WritePolicy};
use std::sync::Arc;

const BS: usize = 4096;
const BLOCKS: u64 = 128 * 1024;
/// Blocks per write.
const WRITE: u64 = 256;

/// Block `i`: unique, and compressible so the simulated disk stays small.
fn block(i: u64) -> Vec<u8> {
    let mut b = vec![0u8; BS];
    for (k, w) in b.chunks_mut(8).enumerate() {
        w.copy_from_slice(&(i * 1_000_003 + k as u64 / 64).to_le_bytes());
    }
    b
}

fn opts() -> OpenOptions {
    OpenOptions {
        // No checkpoint while `b` is written: the close's is the one that rewrites the table.
        journal_bytes_max: 1 << 30,
        ..Default::default()
    }
}

fn open(disk: &Arc<SimDir>) -> Result<Arc<Pool>, String> {
    Pool::open(Arc::new(SimHandle(disk.clone())), opts()).map_err(|e| format!("open: {e}"))
}

fn write_volume(pool: &Pool, name: &str) -> Result<(), String> {
    pool.create_volume(name, BLOCKS * BS as u64)
        .map_err(|e| format!("create {name}: {e}"))?;
    let h = pool.volume(name).map_err(|e| e.to_string())?;
    for first in (0..BLOCKS).step_by(WRITE as usize) {
        let data: Vec<u8> = (first..first + WRITE).flat_map(block).collect();
        h.write_at(first * BS as u64, &data, false)
            .map_err(|e| format!("write {name} at block {first}: {e}"))?;
    }
    Ok(())
}

/// The disk just before the close: `a` checkpointed, `b` only journaled and flushed.
fn before_close() -> Result<Arc<SimDir>, String> {
    let disk = SimDir::new();
    let init = InitOptions {
        block_size: BS as u32,
        compression: Compression::Lz4,
        write_policy: WritePolicy::Async,
        segment_bytes_target: 8 << 20,
        metadata_cache_bytes: None,
        encryption: None,
    };
    Pool::init(&SimHandle(disk.clone()), &init).map_err(|e| format!("init: {e}"))?;
    let pool = open(&disk)?;
    write_volume(&pool, "a")?;
    pool.close().map_err(|e| format!("close: {e}"))?;
    drop(pool);
    let pool = open(&disk)?;
    write_volume(&pool, "b")?;
    pool.flush().map_err(|e| format!("flush: {e}"))?;
    // Everything is synced: the crash image is the disk as it is, without a close.
    let image = disk.crash(&mut SimRng::new(0));
    drop(pool);
    Ok(image)
}

fn meta_len(disk: &Arc<SimDir>) -> Result<u64, String> {
    let f = condense_engine::io::Dir::open(&SimHandle(disk.clone()), "meta.dat", false)
        .map_err(|e| format!("meta.dat: {e}"))?;
    f.len().map_err(|e| format!("meta.dat: {e}"))
}

/// Reopened after the crash: verify is clean and both volumes read back whole.
fn check(disk: &Arc<SimDir>) -> Result<(), String> {
    let pool = open(disk)?;
    let report = pool
        .verify(&|_, _| {})
        .map_err(|e| format!("verify: {e}"))?;
    if !report.is_clean() {
        return Err(format!("verify: {report:?}"));
    }
    let mut buf = vec![0u8; (WRITE as usize) * BS];
    for name in ["a", "b"] {
        let h = pool.volume(name).map_err(|e| e.to_string())?;
        for first in (0..BLOCKS).step_by(WRITE as usize) {
            h.read_at(first * BS as u64, &mut buf)
                .map_err(|e| format!("read {name} at block {first}: {e}"))?;
            for (k, got) in buf.chunks(BS).enumerate() {
                if got != block(first + k as u64) {
                    return Err(format!("{name} block {} is wrong", first + k as u64));
                }
            }
        }
    }
    pool.close()
        .map_err(|e| format!("close after recovery: {e}"))
}

#[test]
fn a_crash_anywhere_in_a_compacting_close_loses_nothing() -> Result<(), String> {
    let base = before_close()?;
    // A clean close, counted: it compacts (meta.dat ends near its live pages).
    let disk = base.crash(&mut SimRng::new(0));
    let pool = open(&disk)?;
    let (from, before) = (disk.calls(), meta_len(&disk)?);
    pool.close().map_err(|e| format!("close: {e}"))?;
    let close_calls = disk.calls() - from;
    let live = pool
        .stats()
        .map_err(|e| e.to_string())?
        .metadata_page_bytes_live;
    drop(pool);
    let after = meta_len(&disk)?;
    // Without compaction the old copies of every rewritten leaf (about `live` again) stay.
    assert!(
        after < live + live / 4 + (64 << 10),
        "meta.dat {after} bytes after the close ({before} before it), {live} of pages in use"
    );
    check(&disk)?;
    let seeds: u64 = std::env::var("CONDENSE_COMPACTION_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(12);
    for seed in 1..=seeds {
        let mut rng = SimRng::new(seed);
        let disk = base.crash(&mut rng);
        let pool = open(&disk)?;
        let stop = rng.below(close_calls + 1);
        disk.stop_after(stop);
        let closed = pool.close();
        drop(pool);
        let crashed = disk.crash(&mut rng);
        check(&crashed).map_err(|e| {
            format!(
                "seed {seed}, stopped after {stop} of {close_calls} calls (close {closed:?}): {e}"
            )
        })?;
    }
    Ok(())
}

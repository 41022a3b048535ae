//! Background release of deleted maps (crates/engine/src/pool/release.rs): a deletion
//! returns at once, its map goes in steps, and a crash at any step boundary resumes the
//! release and frees exactly the chunks only the deleted volume held.

use condense_engine::sim::{SimDir, SimHandle, SimRng};
use condense_engine::{Compression, InitOptions, OpenOptions, Pool, WritePolicy};
use std::collections::HashSet;
use std::sync::Arc;

const BS: usize = 4096;
/// Blocks a model volume has, one per leaf (each written block is `SPREAD` blocks apart),
/// so the maps have two levels and a release of one leaf a step takes many steps.
const BLOCKS: u64 = 40;
const SPREAD: u64 = 512;

fn content(tag: u64) -> Vec<u8> {
    let mut b: Vec<u8> = (0..BS).map(|i| ((i / 64) as u64 ^ tag) as u8).collect();
    b[..8].copy_from_slice(&tag.to_le_bytes());
    b
}

fn opts() -> OpenOptions {
    OpenOptions {
        release_in_background: false,
        release_step_leaves: 1,
        destage_in_background: false,
        journal_bytes_max: 64 << 10,
        metadata_cache_bytes: Some(8 * 4096),
        ..Default::default()
    }
}

fn open(disk: &Arc<SimDir>) -> Result<Arc<Pool>, String> {
    Pool::open(Arc::new(SimHandle(disk.clone())), opts()).map_err(|e| format!("open: {e}"))
}

/// Write `tags[i]` at model block i of `name`.
fn write(pool: &Pool, name: &str, tags: &[(u64, u64)]) -> Result<(), String> {
    let h = pool.volume(name).map_err(|e| e.to_string())?;
    for &(block, tag) in tags {
        h.write_at(block * SPREAD * BS as u64, &content(tag), false)
            .map_err(|e| format!("{name} block {block}: {e}"))?;
    }
    Ok(())
}

/// Write `tags[i]` at model block i of `name`, for every i.
fn write_all(pool: &Pool, name: &str, tags: &[u64]) -> Result<(), String> {
    let blocks: Vec<(u64, u64)> = (0..).zip(tags.iter().copied()).collect();
    write(pool, name, &blocks)
}

/// A pool on its simulated disk, and the tags its volume "v" holds.
type PoolWithV = (Arc<SimDir>, Arc<Pool>, Vec<u64>);

/// A new pool on a simulated disk with volume "v" of `BLOCKS` model blocks holding
/// `first_tag + i` at block i.
fn pool_with_v(first_tag: u64) -> Result<PoolWithV, String> {
    let disk = SimDir::new();
    Pool::init(&SimHandle(disk.clone()), &InitOptions::default())
        .map_err(|e| format!("init: {e}"))?;
    let pool = open(&disk)?;
    pool.create_volume("v", BLOCKS * SPREAD * BS as u64)
        .map_err(|e| e.to_string())?;
    let tags: Vec<u64> = (0..BLOCKS).map(|b| first_tag + b).collect();
    write_all(&pool, "v", &tags)?;
    Ok((disk, pool, tags))
}

/// Check that `name` holds `tags` at its model blocks.
fn check(pool: &Pool, name: &str, tags: &[u64]) -> Result<(), String> {
    let h = pool.volume(name).map_err(|e| format!("{name}: {e}"))?;
    for (block, &tag) in tags.iter().enumerate() {
        let mut buf = vec![0u8; BS];
        h.read_at(block as u64 * SPREAD * BS as u64, &mut buf)
            .map_err(|e| format!("{name} block {block}: {e}"))?;
        if buf != content(tag) {
            return Err(format!("{name} block {block}: not tag {tag}"));
        }
    }
    Ok(())
}

/// The reopened pool after a crash: the release resumes and finishes, nothing another
/// volume holds is lost, and after GC the pool holds exactly `live` distinct chunks.
fn check_recovered(
    disk: &Arc<SimDir>,
    models: &[(&str, Vec<u64>)],
    live: usize,
) -> Result<(), String> {
    let pool = open(disk)?;
    for (name, tags) in models {
        check(&pool, name, tags)?;
    }
    pool.finish_releases(&|_, _| {})
        .map_err(|e| format!("finishing the release: {e}"))?;
    if !pool.pending_releases().is_empty() {
        return Err("a release is still pending after finish_releases".into());
    }
    pool.gc(0).map_err(|e| format!("gc: {e}"))?;
    for (name, tags) in models {
        check(&pool, name, tags)?;
    }
    let report = pool
        .verify(&|_, _| {})
        .map_err(|e| format!("verify: {e}"))?;
    if !report.is_clean() {
        return Err(format!("verify: {report:?}"));
    }
    let chunks = pool.stats().map_err(|e| e.to_string())?.unique_chunks;
    if chunks != live as u64 {
        return Err(format!(
            "{chunks} chunks live after the release and GC; the remaining volumes hold {live}"
        ));
    }
    pool.check_attribution()
        .map_err(|e| format!("space attribution: {e}"))?;
    Ok(())
}

/// A clone shares its snapshot's pages; half of it is then overwritten. Deleting it
/// releases one leaf a step; a new volume takes its name at once. At every step boundary
/// the disk is crashed (after a flush) and the reopened pool checked.
#[test]
fn a_delete_interrupted_at_every_step_resumes_and_frees_exactly_its_own_chunks(
) -> Result<(), String> {
    let disk = SimDir::new();
    let init = InitOptions {
        block_size: BS as u32,
        compression: Compression::Lz4,
        write_policy: WritePolicy::Async,
        segment_bytes_target: 1 << 16,
        metadata_cache_bytes: None,
        encryption: None,
    };
    Pool::init(&SimHandle(disk.clone()), &init).map_err(|e| format!("init: {e}"))?;
    let pool = open(&disk)?;
    let size = BLOCKS * SPREAD * BS as u64;
    pool.create_volume("base", size)
        .map_err(|e| e.to_string())?;
    let base: Vec<u64> = (0..BLOCKS).map(|b| 1000 + b).collect();
    write_all(&pool, "base", &base)?;
    pool.create_snapshot("base", "s")
        .map_err(|e| e.to_string())?;
    pool.clone_volume("base@s", "vm")
        .map_err(|e| e.to_string())?;
    // Half the clone's blocks get contents of their own (its leaves there are its own).
    let mut vm = base.clone();
    let mut own = Vec::new();
    for b in (0..BLOCKS).step_by(2) {
        vm[b as usize] = 5000 + b;
        own.push((b, 5000 + b));
    }
    write(&pool, "vm", &own)?;
    pool.flush().map_err(|e| e.to_string())?;
    check(&pool, "vm", &vm)?;

    pool.delete_volume("vm").map_err(|e| e.to_string())?;
    // The name is free at once; the new volume's content is its own.
    pool.create_volume("vm", size).map_err(|e| e.to_string())?;
    let new_vm: Vec<u64> = (0..BLOCKS).map(|b| 9000 + b).collect();
    write_all(&pool, "vm", &new_vm)?;
    pool.flush().map_err(|e| e.to_string())?;
    let pending = pool.pending_releases();
    if pending.len() != 1 || pending[0].name != "vm" || pending[0].data_blocks != BLOCKS {
        return Err(format!("pending releases after the delete: {pending:?}"));
    }
    let models = [
        ("base", base.clone()),
        ("base@s", base.clone()),
        ("vm", new_vm.clone()),
    ];
    let live: HashSet<u64> = base.iter().chain(new_vm.iter()).copied().collect();
    let mut rng = SimRng::new(7);
    let mut steps = 0;
    loop {
        check_recovered(&disk.crash(&mut rng), &models, live.len())
            .map_err(|e| format!("after {steps} steps: {e}"))?;
        if !pool.release_step().map_err(|e| e.to_string())? {
            break;
        }
        pool.flush().map_err(|e| e.to_string())?;
        steps += 1;
    }
    // One leaf a step: one step per leaf the clone had, and its space is back.
    if steps < BLOCKS / 2 {
        return Err(format!(
            "the release took {steps} steps for {BLOCKS} leaves"
        ));
    }
    pool.gc(0).map_err(|e| e.to_string())?;
    let chunks = pool.stats().map_err(|e| e.to_string())?.unique_chunks;
    if chunks != live.len() as u64 {
        return Err(format!("{chunks} chunks live, {} expected", live.len()));
    }
    for (name, tags) in &models {
        check(&pool, name, tags)?;
    }
    Ok(())
}

/// A rollback's old map is released the same way, and the volume reads its snapshot.
#[test]
fn a_rollback_releases_the_old_map_in_steps() -> Result<(), String> {
    let (disk, pool, before) = pool_with_v(100)?;
    pool.create_snapshot("v", "s").map_err(|e| e.to_string())?;
    let after: Vec<(u64, u64)> = (0..BLOCKS).map(|b| (b, 700 + b)).collect();
    write(&pool, "v", &after)?;
    pool.rollback_volume("v", "s", true)
        .map_err(|e| e.to_string())?;
    check(&pool, "v", &before)?;
    let pending = pool.pending_releases();
    if pending.len() != 1 || pending[0].name != "v (before rollback)" {
        return Err(format!("pending releases after the rollback: {pending:?}"));
    }
    let live = before.len();
    check_recovered(
        &disk.crash(&mut SimRng::new(3)),
        &[("v", before.clone())],
        live,
    )?;
    pool.finish_releases(&|_, _| {})
        .map_err(|e| e.to_string())?;
    pool.gc(0).map_err(|e| e.to_string())?;
    check(&pool, "v", &before)?;
    let chunks = pool.stats().map_err(|e| e.to_string())?.unique_chunks;
    if chunks != live as u64 {
        return Err(format!("{chunks} chunks live, {live} expected"));
    }
    Ok(())
}

/// Shrinking with data past the new end cuts it off in steps from the end: what is left
/// reads as before, what was cut reads as zeros once grown back, and verify is clean.
#[test]
fn a_shrink_in_steps_keeps_what_is_left_and_drops_the_rest() -> Result<(), String> {
    let (_disk, pool, tags) = pool_with_v(300)?;
    let size = BLOCKS * SPREAD * BS as u64;
    let keep = 3;
    if pool
        .resize_volume("v", keep * SPREAD * BS as u64, false)
        .is_ok()
    {
        return Err("a shrink over written blocks was accepted without --force".into());
    }
    pool.resize_volume("v", keep * SPREAD * BS as u64, true)
        .map_err(|e| e.to_string())?;
    check(&pool, "v", &tags[..keep as usize])?;
    pool.resize_volume("v", size, false)
        .map_err(|e| e.to_string())?;
    let h = pool.volume("v").map_err(|e| e.to_string())?;
    for block in keep..BLOCKS {
        let mut buf = vec![1u8; BS];
        h.read_at(block * SPREAD * BS as u64, &mut buf)
            .map_err(|e| e.to_string())?;
        if buf.iter().any(|&b| b != 0) {
            return Err(format!("block {block} past the shrink still holds data"));
        }
    }
    drop(h);
    pool.gc(0).map_err(|e| e.to_string())?;
    let report = pool.verify(&|_, _| {}).map_err(|e| e.to_string())?;
    if !report.is_clean() {
        return Err(format!("verify: {report:?}"));
    }
    let chunks = pool.stats().map_err(|e| e.to_string())?.unique_chunks;
    if chunks != keep {
        return Err(format!(
            "{chunks} chunks live after the shrink and GC, {keep} expected"
        ));
    }
    Ok(())
}

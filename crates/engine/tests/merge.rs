//! The merge pass (crates/engine/src/pool/merge.rs, issue 43) through a pool: duplicates the
//! sparse index let through become forwards, every block reads what was written, verify is
//! clean, GC gets their space back and the per-volume figures see the sharing; a crash in the
//! middle of the pass loses nothing, a long pass makes its forwards durable as it goes, and
//! the next pass finishes the work.

mod common;
use common::damage_record_of;
use condense_engine::index::{IndexSetting, SETTING_KEY};
use condense_engine::sim::{SimDir, SimHandle, SimRng};
use condense_engine::{Compression, InitOptions, OpenOptions, Pool};
use std::sync::{Arc, Mutex};

const BS: usize = 4096;
/// Distinct blocks: 128 chunk-table pages, far more than the smallest sparse index's locality
/// cache holds (~43 pages), so much of a scrambled copy is missed inline.
const BLOCKS: u64 = 16384;

fn block(tag: u64) -> Vec<u8> {
    let h = blake3::hash(&tag.to_le_bytes());
    h.as_bytes().iter().copied().cycle().take(BS).collect()
}

/// The tag block `b` of a volume holds: in order for "a", scrambled for the others.
fn tag(name: &str, b: u64) -> u64 {
    match name {
        "a" => b,
        _ => (b * 7919) % BLOCKS,
    }
}

fn open(disk: &Arc<SimDir>) -> Result<Arc<Pool>, String> {
    common::open_sim(disk)
}

fn write(pool: &Pool, name: &str) -> Result<(), String> {
    pool.create_volume(name, BLOCKS * BS as u64)
        .map_err(|e| format!("create {name}: {e}"))?;
    let h = pool.volume(name).map_err(|e| e.to_string())?;
    for b in 0..BLOCKS {
        h.write_at(b * BS as u64, &block(tag(name, b)), false)
            .map_err(|e| format!("{name} block {b}: {e}"))?;
    }
    pool.flush().map_err(|e| e.to_string())
}

fn check(pool: &Pool, name: &str) -> Result<(), String> {
    let h = pool.volume(name).map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; BS];
    for b in 0..BLOCKS {
        h.read_at(b * BS as u64, &mut buf)
            .map_err(|e| format!("{name} block {b}: {e}"))?;
        if buf != block(tag(name, b)) {
            return Err(format!("{name} block {b} reads other data"));
        }
    }
    Ok(())
}

fn verify_clean(pool: &Pool, when: &str) -> Result<(), String> {
    let r = pool.verify(&|_, _| {}).map_err(|e| e.to_string())?;
    if !r.is_clean() {
        return Err(format!("verify {when}: {r:?}"));
    }
    Ok(())
}

fn unique(pool: &Pool) -> Result<u64, String> {
    Ok(pool.stats().map_err(|e| e.to_string())?.unique_chunks)
}

/// A pool with the smallest sparse index, volume "a" in order and "b" the same blocks
/// scrambled: many of b's blocks are stored again (about half or more, depending on where the
/// pool's key puts the hooks).
fn pool_with_duplicates() -> Result<(Arc<SimDir>, Arc<Pool>), String> {
    let disk = SimDir::new();
    // Small segments: the duplicates' records fill segments GC can empty.
    let init = InitOptions {
        segment_bytes_target: 256 << 10,
        ..Default::default()
    };
    Pool::init(&SimHandle(disk.clone()), &init).map_err(|e| format!("init: {e}"))?;
    let pool = common::open_sparse(&disk, 256 << 10)?;
    write(&pool, "a")?;
    write(&pool, "b")?;
    let stored = unique(&pool)?;
    assert!(
        stored > BLOCKS + BLOCKS / 4,
        "the sparse index should miss much of a scrambled copy: {stored} chunks"
    );
    Ok((disk, pool))
}

#[test]
fn duplicates_become_forwards_and_their_space_comes_back() -> Result<(), String> {
    let (disk, pool) = pool_with_duplicates()?;
    let before = unique(&pool)?;
    let a = pool.volume_stats("a").map_err(|e| e.to_string())?;
    assert!(a.exclusive_bytes().unwrap_or(0) > 0, "{a:?}");
    // A budget of 1,024 entries: the sort goes through many runs.
    let r = pool
        .merge_duplicates(24 << 10, &|_, _| {})
        .map_err(|e| e.to_string())?;
    assert!(r.runs > 10, "{r:?}");
    assert_eq!(r.chunks_sorted, before);
    assert_eq!(r.merged, before - BLOCKS, "{r:?}");
    assert_eq!(unique(&pool)?, BLOCKS);
    check(&pool, "a")?;
    check(&pool, "b")?;
    verify_clean(&pool, "after the merge")?;
    // The figures see the sharing at once: nothing is a's alone any more.
    let a = pool.volume_stats("a").map_err(|e| e.to_string())?;
    assert_eq!(a.exclusive_bytes(), Some(0), "{a:?}");
    let bytes = pool.stats().map_err(|e| e.to_string())?.physical_bytes;
    let g = pool.gc(0).map_err(|e| e.to_string())?;
    assert!(g.bytes_after < g.bytes_before, "{g:?}");
    assert!(pool.stats().map_err(|e| e.to_string())?.physical_bytes <= bytes);
    check(&pool, "b")?;
    verify_clean(&pool, "after GC")?;
    // A second pass finds nothing; the data written again is found through the forwards.
    let again = pool
        .merge_duplicates(1 << 20, &|_, _| {})
        .map_err(|e| e.to_string())?;
    assert_eq!(again.merged, 0, "{again:?}");
    pool.close().map_err(|e| e.to_string())?;
    let pool = open(&disk)?;
    check(&pool, "b")?;
    verify_clean(&pool, "after reopening")?;
    // Blocks named through forwards are overwritten and trimmed: the forwards go with them.
    let h = pool.volume("b").map_err(|e| e.to_string())?;
    h.write_at(0, &vec![7u8; BS * 64], false)
        .map_err(|e| e.to_string())?;
    pool.delete_volume("a").map_err(|e| e.to_string())?;
    verify_clean(&pool, "after overwriting and deleting")?;
    Ok(())
}

/// The crash image a pass's progress callback took.
fn crash_image(crashed: Mutex<Option<Arc<SimDir>>>) -> Result<Arc<SimDir>, String> {
    crashed
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .ok_or_else(|| "the pass never reached the crash point".to_string())
}

#[test]
fn a_crash_in_the_middle_of_the_pass_loses_nothing() -> Result<(), String> {
    let (disk, pool) = pool_with_duplicates()?;
    let before = unique(&pool)?;
    // Crash once the pass is half way through its forwards, after a flush made some durable.
    let crashed: Mutex<Option<Arc<SimDir>>> = Mutex::new(None);
    let p = pool.clone();
    pool.merge_duplicates(1 << 20, &|done, total| {
        let mut c = crashed.lock().unwrap_or_else(|e| e.into_inner());
        if c.is_none() && done * 10 >= total * 6 && done < total {
            let _ = p.flush();
            *c = Some(disk.crash(&mut SimRng::new(11)));
        }
    })
    .map_err(|e| e.to_string())?;
    drop(pool);
    let disk = crash_image(crashed)?;
    let pool = open(&disk)?;
    let left = unique(&pool)?;
    assert!(
        left < before,
        "some forwards were durable: {left} of {before}"
    );
    check(&pool, "a")?;
    check(&pool, "b")?;
    verify_clean(&pool, "after the crash")?;
    let r = pool
        .merge_duplicates(1 << 20, &|_, _| {})
        .map_err(|e| e.to_string())?;
    assert_eq!(r.merged, left - BLOCKS, "{r:?}");
    pool.gc(0).map_err(|e| e.to_string())?;
    check(&pool, "b")?;
    verify_clean(&pool, "after the second pass")
}

/// A long pass flushes as it goes (merge.rs `DURABLE_EVERY`, 1 s): a crash after it paused
/// for longer than that keeps the forwards made before the pause, with no flush of its own.
#[test]
fn a_long_pass_makes_its_forwards_durable_as_it_goes() -> Result<(), String> {
    let (disk, pool) = pool_with_duplicates()?;
    pool.flush().map_err(|e| e.to_string())?;
    let before = unique(&pool)?;
    let crashed: Mutex<Option<Arc<SimDir>>> = Mutex::new(None);
    let batches = std::sync::atomic::AtomicU64::new(0);
    // (done, total): past total / 2, one call per batch of 64 forwards.
    pool.merge_duplicates(1 << 20, &|done, total| {
        if done <= total / 2 || done == total {
            return;
        }
        match batches.fetch_add(1, std::sync::atomic::Ordering::Relaxed) {
            20 => std::thread::sleep(std::time::Duration::from_millis(1100)),
            40 => {
                let mut c = crashed.lock().unwrap_or_else(|e| e.into_inner());
                *c = Some(disk.crash(&mut SimRng::new(5)));
            }
            _ => {}
        }
    })
    .map_err(|e| e.to_string())?;
    drop(pool);
    let disk = crash_image(crashed)?;
    let pool = open(&disk)?;
    let left = unique(&pool)?;
    assert!(
        left <= before - 20 * 64,
        "the forwards made before the pause were not durable: {left} chunks of {before} left"
    );
    check(&pool, "a")?;
    check(&pool, "b")?;
    verify_clean(&pool, "after the crash")
}

/// A chunk merged into and then damaged: the scrub names the blocks of every volume reading
/// it, through a forward or not, and verify finds them too.
#[test]
fn damage_to_a_merged_chunk_names_the_blocks_of_its_forwards_too() -> Result<(), String> {
    let tmp = tempfile::tempdir().map_err(|e| e.to_string())?;
    let dir = tmp.path();
    let init = InitOptions {
        compression: Compression::None,
        segment_bytes_target: 1 << 20,
        ..Default::default()
    };
    Pool::init_path(dir, &init).map_err(|e| format!("init: {e}"))?;
    let open = || Pool::open_path(dir, OpenOptions::default()).map_err(|e| format!("open: {e}"));
    let pool = open()?;
    let setting = IndexSetting::Sparse { budget: 256 << 10 };
    pool.meta_put(SETTING_KEY, Some(&setting.encode()))
        .map_err(|e| e.to_string())?;
    pool.close().map_err(|e| e.to_string())?;
    drop(pool);
    let pool = open()?;
    write(&pool, "a")?;
    write(&pool, "b")?;
    let r = pool
        .merge_duplicates(1 << 20, &|_, _| {})
        .map_err(|e| e.to_string())?;
    assert!(r.merged > BLOCKS / 4, "{r:?}");
    pool.gc(0).map_err(|e| e.to_string())?;
    pool.close().map_err(|e| e.to_string())?;
    drop(pool);
    // Eight chunks: half or more of b's blocks are forwards, so some of these are.
    let tags: Vec<u64> = (0..8).map(|i| 1000 + 1500 * i).collect();
    for &t in &tags {
        damage_record_of(dir, &block(t));
    }
    let pool = open()?;
    let pass = pool
        .scrub_pass(0, &|| true, &|_| {})
        .map_err(|e| e.to_string())?;
    assert_eq!(pass.damaged_chunks, 8, "{pass:?}");
    let mut want: Vec<(String, u64, u64)> = Vec::new();
    for name in ["a", "b"] {
        let mut blocks: Vec<u64> = (0..BLOCKS)
            .filter(|&b| tags.contains(&tag(name, b)))
            .collect();
        blocks.sort_unstable();
        want.extend(blocks.into_iter().map(|b| (name.to_string(), b, 1)));
    }
    assert_eq!(pass.damaged_blocks, want);
    let v = pool.verify(&|_, _| {}).map_err(|e| e.to_string())?;
    let named: usize = v.bad_blocks.values().map(Vec::len).sum();
    assert_eq!(named, 16, "{:?}", v.bad_blocks);
    Ok(())
}

/// The backlog the daemon's schedule reads: every chunk until a whole pass, none after it; a
/// pass stopped part way merges what it reached and is not recorded.
#[test]
fn a_whole_pass_records_its_backlog_and_a_stopped_one_does_not() -> Result<(), String> {
    let (_disk, pool) = pool_with_duplicates()?;
    let before = unique(&pool)?;
    let backlog = pool.merge_backlog();
    assert!(backlog.sparse, "{backlog:?}");
    assert_eq!((backlog.new_chunks, backlog.live_chunks), (before, before));
    let stopped = pool
        .merge_duplicates_until(1 << 20, &|done, total| done * 2 > total)
        .map_err(|e| e.to_string())?;
    assert!(stopped.stopped && stopped.merged > 0, "{stopped:?}");
    assert!(stopped.merged < before - BLOCKS, "{stopped:?}");
    assert_eq!(pool.merge_backlog().new_chunks, before);
    check(&pool, "b")?;
    let whole = pool
        .merge_duplicates(1 << 20, &|_, _| {})
        .map_err(|e| e.to_string())?;
    assert!(!whole.stopped, "{whole:?}");
    assert_eq!(stopped.merged + whole.merged, before - BLOCKS);
    assert_eq!(pool.merge_backlog().new_chunks, 0);
    // New chunks count from the pass's start.
    let h = pool.volume("b").map_err(|e| e.to_string())?;
    h.write_at(0, &vec![9u8; BS], false)
        .map_err(|e| e.to_string())?;
    assert_eq!(pool.merge_backlog().new_chunks, 1);
    check(&pool, "a")?;
    verify_clean(&pool, "after both passes")
}

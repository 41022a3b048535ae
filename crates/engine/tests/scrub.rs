//! The scrub at the engine: a pass finds a damaged chunk record and names every volume and
//! snapshot block naming it, the pass is recorded in the pool, the rate bounds its speed, and
//! the background scrub runs a pass on its own, can be asked for one and stopped.

mod common;
use common::damage_record_of;
use condense_engine::scrub::{BackgroundScrub, ScrubSchedule};
use condense_engine::{Compression, InitOptions, OpenOptions, Pool, WritePolicy};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

const BS: usize = 4096;

fn pool_with_data(dir: &Path, blocks: u64) -> Arc<Pool> {
    let init = InitOptions {
        block_size: BS as u32,
        compression: Compression::None,
        write_policy: WritePolicy::Async,
        segment_bytes_target: 1 << 20,
        metadata_cache_bytes: None,
        encryption: None,
    };
    Pool::init_path(dir, &init).expect("init");
    let pool = Pool::open_path(dir, OpenOptions::default()).expect("open");
    pool.create_volume("vm", blocks * BS as u64)
        .expect("create");
    let data: Vec<u8> = (0..blocks).flat_map(block).collect();
    pool.volume("vm")
        .and_then(|h| h.write_at(0, &data, false))
        .expect("write");
    pool.create_snapshot("vm", "s1").expect("snapshot");
    pool.create_volume("other", 8 * BS as u64).expect("create");
    // A duplicate of vm's block 30: the same chunk.
    pool.volume("other")
        .and_then(|h| h.write_at(5 * BS as u64, &block(30), false))
        .expect("write");
    pool.flush().expect("flush");
    pool
}

fn block(b: u64) -> Vec<u8> {
    (0..BS / 8)
        .flat_map(|i| (0xabcd_u64 << 40 ^ b << 16 ^ i as u64).to_le_bytes())
        .collect()
}

#[test]
fn a_pass_names_every_block_of_a_damaged_chunk_and_is_recorded() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let pool = pool_with_data(dir, 200);
    let clean = pool.scrub_pass(0, &|| true, &|_| {}).expect("scrub");
    assert_eq!((clean.chunks_checked, clean.damaged_chunks), (200, 0));
    assert!(clean.bytes_checked >= 200 * BS as u64, "{clean:?}");
    pool.close().expect("close");
    drop(pool);

    damage_record_of(dir, &block(30));
    let pool = Pool::open_path(dir, OpenOptions::default()).expect("open");
    // The clean pass was recorded in the pool.
    let before = pool.scrub_status().last.expect("a recorded pass");
    assert_eq!(before.damaged_chunks, 0);
    let seen = std::sync::Mutex::new(0u64);
    let pass = pool
        .scrub_pass(0, &|| true, &|p| {
            *seen.lock().expect("lock") = p.chunks_checked
        })
        .expect("scrub");
    assert_eq!(pass.damaged_chunks, 1, "{pass:?}");
    assert_eq!(pass.chunks_checked, 200);
    assert_eq!(*seen.lock().expect("lock"), 200, "progress reached the end");
    assert!(pass.damaged[0].1.contains("checksum"), "{pass:?}");
    assert_eq!(
        pass.damaged_blocks,
        vec![
            ("other".to_string(), 5, 1),
            ("vm".to_string(), 30, 1),
            ("vm@s1".to_string(), 30, 1),
        ]
    );
    pool.close().expect("close");
    drop(pool);
    let pool = Pool::open_path(dir, OpenOptions::default()).expect("open");
    let last = pool.scrub_status().last.expect("recorded");
    assert_eq!(last.damaged_chunks, 1);
    assert_eq!(last.damaged_blocks, pass.damaged_blocks);
    // A scrub only reads: verify still finds the damage, the same chunk.
    let v = pool.verify(&|_, _| {}).expect("verify");
    assert_eq!(v.bad_chunks.len(), 1);
    assert_eq!(v.bad_chunks[0].0, pass.damaged[0].0);
}

#[test]
fn the_rate_bounds_a_pass_and_a_stop_ends_it() {
    let tmp = tempfile::tempdir().expect("tempdir");
    // Four windows of 1,024 chunks.
    let pool = pool_with_data(tmp.path(), 4096);
    // 4096 records of ~4 KiB at 16 MiB/s: at least ~0.8 s.
    let rate = 16 << 20;
    let t = Instant::now();
    let pass = pool.scrub_pass(rate, &|| true, &|_| {}).expect("scrub");
    let floor = Duration::from_secs_f64(pass.bytes_checked as f64 / rate as f64 * 0.8);
    assert!(
        t.elapsed() >= floor,
        "{:?} for {} bytes at {rate} B/s",
        t.elapsed(),
        pass.bytes_checked
    );
    // Stopped from elsewhere (as `condense scrub --stop` does): ends early, recorded as stopped.
    let p2 = pool.clone();
    let stopper = std::thread::spawn(move || {
        while !p2.scrub_status().running {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(p2.stop_scrub());
    });
    let stopped = pool.scrub_pass(4 << 20, &|| true, &|_| {}).expect("scrub");
    stopper.join().expect("stopper");
    assert!(
        stopped.stopped && stopped.chunks_checked < 4096,
        "{stopped:?}"
    );
    assert!(pool.scrub_status().last.expect("recorded").stopped);
    // A pass cut short because the process stops is not recorded.
    let cut = pool.scrub_pass(1 << 20, &|| false, &|_| {}).expect("scrub");
    assert!(cut.stopped);
    assert!(pool
        .scrub_status()
        .last
        .expect("recorded")
        .finished_unix
        .is_some());
    assert!(!pool.stop_scrub(), "nothing runs now");
}

#[test]
fn the_background_scrub_runs_when_due_and_when_asked() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let pool = pool_with_data(tmp.path(), 64);
    let wait_for = |what: &str, f: &dyn Fn() -> bool| {
        let t = Instant::now();
        while !f() {
            assert!(t.elapsed() < Duration::from_secs(30), "{what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    {
        // Never scrubbed: due at once; then not again for a day.
        let _bg = BackgroundScrub::start(
            &pool,
            ScrubSchedule {
                rate_bytes_per_sec: 64 << 20,
                every: Duration::from_secs(86400),
            },
        );
        wait_for("a first pass", &|| pool.scrub_status().last.is_some());
        let first = pool.scrub_status().last.expect("pass");
        assert_eq!(first.chunks_checked, 64);
        // Past the second the first pass ended in, so that the next one differs from it.
        std::thread::sleep(Duration::from_millis(1100));
        assert_eq!(
            pool.scrub_status().last,
            Some(first.clone()),
            "not due again"
        );
        // Asked for: runs now.
        assert!(pool.request_scrub());
        wait_for("the pass asked for", &|| {
            let s = pool.scrub_status();
            !s.running && s.last.as_ref() != Some(&first)
        });
    }
    assert!(!pool.scrub_status().running, "stopped with its handle");
}

/// A record damaged in its segment while the cache tier holds a valid copy: the scrub writes
/// the chunk again from the copy (healed, not damaged), verify is then clean, the block reads,
/// and GC reclaims the damaged record's segment space.
#[test]
fn a_damaged_record_is_healed_from_the_cache_tiers_copy() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("pool");
    let pool = pool_with_data(&dir, 64);
    let cache_dir = tmp.path().join("cache");
    std::fs::create_dir(&cache_dir).expect("mkdir");
    pool.attach_cache(
        Arc::new(condense_engine::io::RealDir::new(&cache_dir)),
        condense_engine::CacheConf {
            path: cache_dir.to_string_lossy().into_owned(),
            size_bytes: 4096 + 256 * 4224,
            mode: condense_engine::CacheMode::WriteThrough,
        },
    )
    .expect("attach");
    // Read everything once: each record is promoted into the cache tier.
    let mut all = vec![0u8; 64 * BS];
    pool.volume("vm")
        .and_then(|h| h.read_at(0, &mut all))
        .expect("read");
    pool.cache_drain();
    damage_record_of(&dir, &block(7));
    let pass = pool.scrub_pass(0, &|| true, &|_| {}).expect("scrub");
    assert_eq!(
        (pass.healed_chunks, pass.damaged_chunks),
        (1, 0),
        "{pass:?}"
    );
    assert!(pool.verify(&|_, _| {}).expect("verify").is_clean());
    let mut b = vec![0u8; BS];
    pool.volume("vm@s1")
        .and_then(|h| h.read_at(7 * BS as u64, &mut b))
        .expect("read");
    assert!(b == block(7));
    pool.gc(1).expect("gc");
    pool.close().expect("close");
    drop(pool);
    let pool = Pool::open_path(&dir, OpenOptions::default()).expect("open");
    assert!(pool.verify(&|_, _| {}).expect("verify").is_clean());
    assert_eq!(pool.scrub_status().last.expect("recorded").healed_chunks, 1);
}

/// GC keeps a segment holding a damaged live record (moving its other chunks) instead of
/// failing: the damage stays where verify and repair find it.
#[test]
fn gc_keeps_a_segment_with_a_damaged_record_and_moves_the_rest() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let pool = pool_with_data(dir, 600);
    pool.delete_snapshot("vm", "s1").expect("delete snapshot");
    // Most of vm's blocks overwritten: their old records are dead.
    let fresh: Vec<u8> = (0..500).flat_map(|b| block(100_000 + b)).collect();
    pool.volume("vm")
        .and_then(|h| h.write_at(100 * BS as u64, &fresh, false))
        .expect("overwrite");
    pool.flush().expect("flush");
    pool.close().expect("close");
    drop(pool);
    damage_record_of(dir, &block(30));
    let pool = Pool::open_path(dir, OpenOptions::default()).expect("open");
    let r = pool.gc(10).expect("gc goes on past the damaged record");
    assert!(r.chunks_moved > 0, "{r:?}");
    let v = pool.verify(&|_, _| {}).expect("verify");
    assert_eq!(v.bad_chunks.len(), 1, "{v:?}");
    assert_eq!(
        v.bad_blocks.keys().cloned().collect::<Vec<_>>(),
        vec!["other".to_string(), "vm".to_string()]
    );
    // Every other block still reads.
    let mut b = vec![0u8; BS];
    let h = pool.volume("vm").expect("volume");
    for blk in [0u64, 29, 31, 99, 100, 599] {
        h.read_at(blk * BS as u64, &mut b).expect("read");
    }
}

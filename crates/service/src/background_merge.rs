//! The background merge pass: a thread that runs the pool's merge pass ([`Pool::merge_duplicates`],
//! the room `pool/merge.rs`, whose docs say how it keeps crash safety and bounds its holds of
//! the state lock) when enough chunks were written since the last pass, then a GC of the
//! segments it left partly dead.
//!
//! Owns: [`BackgroundMerge`] and when it runs ([`MergeSchedule`]). Only a pool whose dedup
//! index is sparse is merged by it (a dense index misses no duplicate inline); `condense
//! index merge` runs a pass by hand whatever the mode.

use condense_engine::pool::merge::MergeBacklog;
use condense_engine::Pool;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// When [`BackgroundMerge`] runs a pass.
#[derive(Clone, Copy, Debug)]
pub struct MergeSchedule {
    /// How often the backlog is looked at (and the least time between two passes).
    pub every: Duration,
    /// A pass is due once the chunks written since the last pass are at least this share of
    /// the live chunks (in percent) ...
    pub new_percent: u8,
    /// ... and at least this many.
    pub new_min: u64,
    /// The pass's RAM for its sort (bytes).
    pub memory: u64,
    /// After a pass that merged something: compact segments at least this percent dead.
    pub gc_dead_percent: u8,
}

impl MergeSchedule {
    /// A pass is due for `b`.
    pub fn due(&self, b: &MergeBacklog) -> bool {
        b.sparse
            && b.new_chunks >= self.new_min
            && b.new_chunks.saturating_mul(100)
                >= b.live_chunks.saturating_mul(u64::from(self.new_percent))
    }
}

/// A background thread running the merge pass on a [`MergeSchedule`]; stops when dropped
/// (a pass under way stops at its next step: what it journaled stays, the next pass finds
/// the rest).
pub struct BackgroundMerge {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl BackgroundMerge {
    pub fn start(pool: &Arc<Pool>, schedule: MergeSchedule) -> BackgroundMerge {
        let stop = Arc::new(AtomicBool::new(false));
        let weak = Arc::downgrade(pool);
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let tick = Duration::from_millis(200).min(schedule.every);
            let mut last = Instant::now();
            while !flag.load(Ordering::Relaxed) {
                std::thread::sleep(tick);
                if last.elapsed() < schedule.every {
                    continue;
                }
                last = Instant::now();
                let Some(pool) = weak.upgrade() else { return };
                let backlog = pool.merge_backlog();
                if pool.is_read_only() || !schedule.due(&backlog) {
                    continue;
                }
                tracing::info!(
                    "background merge: {} of {} live chunks written since the last pass",
                    backlog.new_chunks,
                    backlog.live_chunks
                );
                run_pass(&pool, &schedule, &flag);
                last = Instant::now();
            }
        });
        BackgroundMerge {
            stop,
            thread: Some(thread),
        }
    }
}

/// One pass and its GC, logged; stops early (an error it logs) once `stop` is set.
fn run_pass(pool: &Pool, schedule: &MergeSchedule, stop: &AtomicBool) {
    let stopping = |_: u64, _: u64| stop.load(Ordering::Relaxed);
    let report = match pool.merge_duplicates_until(schedule.memory, &stopping) {
        Ok(r) if r.stopped => return,
        Ok(r) => r,
        Err(e) => {
            tracing::warn!("background merge failed: {e} (the chunks merged so far stay merged)");
            return;
        }
    };
    tracing::info!(
        "background merge: {} duplicate chunks merged, {} bytes of records to reclaim",
        report.merged,
        report.record_bytes_merged
    );
    if report.merged > 0 && !stop.load(Ordering::Relaxed) {
        match pool.gc(schedule.gc_dead_percent) {
            Ok(r) => tracing::info!(
                "background merge: gc removed {} segments, moved {} chunks",
                r.segments_removed,
                r.chunks_moved
            ),
            Err(e) => tracing::warn!("background merge: gc failed: {e}"),
        }
    }
}

impl Drop for BackgroundMerge {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use condense_engine::index::{IndexSetting, SETTING_KEY};
    use condense_engine::sim::{SimDir, SimHandle, SimRng};
    use condense_engine::{InitOptions, OpenOptions};

    const BS: usize = 4096;
    /// Distinct blocks: 128 chunk-table pages, far more than the smallest sparse index's
    /// locality cache holds, so a scrambled copy is mostly stored again inline.
    const BLOCKS: u64 = 16384;

    fn block(tag: u64) -> Vec<u8> {
        let mut rng = SimRng::new(tag + 1);
        (0..BS / 8)
            .flat_map(|_| rng.next_u64().to_le_bytes())
            .collect()
    }

    fn open(disk: &Arc<SimDir>) -> Arc<Pool> {
        let opts = OpenOptions {
            destage_in_background: false,
            release_in_background: false,
            ..Default::default()
        };
        Pool::open(Arc::new(SimHandle(disk.clone())), opts).expect("open")
    }

    /// Volume `name` of BLOCKS blocks, block b holding `block(order(b))`.
    fn write(pool: &Pool, name: &str, order: impl Fn(u64) -> u64) {
        pool.create_volume(name, BLOCKS * BS as u64)
            .expect("create");
        let h = pool.volume(name).expect("volume");
        for b in 0..BLOCKS {
            h.write_at(b * BS as u64, &block(order(b)), false)
                .expect("write");
        }
        pool.flush().expect("flush");
    }

    fn reads_back(pool: &Pool, name: &str, order: impl Fn(u64) -> u64) -> bool {
        let h = pool.volume(name).expect("volume");
        let mut buf = vec![0u8; BS];
        (0..BLOCKS).all(|b| h.read_at(b * BS as u64, &mut buf).is_ok() && buf == block(order(b)))
    }

    /// The daemon's background merge on a sparse pool holding a scrambled copy: it runs
    /// once due, merges every duplicate, records the pass and compacts what it left dead;
    /// then a few new chunks are not due, and a dense pool never is.
    #[test]
    fn the_background_merge_runs_when_due_then_waits() {
        let disk = SimDir::new();
        let init = InitOptions {
            segment_bytes_target: 256 << 10,
            ..Default::default()
        };
        Pool::init(&SimHandle(disk.clone()), &init).expect("init");
        let pool = open(&disk);
        let sparse = IndexSetting::Sparse { budget: 256 << 10 };
        pool.meta_put(SETTING_KEY, Some(&sparse.encode()))
            .expect("set sparse");
        pool.close().expect("close");
        drop(pool);
        let pool = open(&disk);
        let scrambled = |b: u64| (b * 7919) % BLOCKS;
        write(&pool, "a", |b| b);
        write(&pool, "b", scrambled);
        let stored = pool.stats().expect("stats").unique_chunks;
        assert!(stored > BLOCKS + BLOCKS / 2, "{stored} chunks");
        let bytes = pool.stats().expect("stats").physical_bytes;
        let schedule = MergeSchedule {
            every: Duration::from_millis(20),
            new_percent: 5,
            new_min: 1,
            memory: 1 << 20,
            gc_dead_percent: 0,
        };
        assert!(schedule.due(&pool.merge_backlog()));
        let bg = BackgroundMerge::start(&pool, schedule);
        let t = Instant::now();
        // Merged (the pass recorded) and compacted: a third of the records were copies.
        while pool.merge_backlog().new_chunks > 0
            || pool.stats().expect("stats").physical_bytes > bytes / 4 * 3
        {
            assert!(
                t.elapsed() < Duration::from_secs(120),
                "no background merge and GC in 120 s: {:?}",
                pool.merge_backlog()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        drop(bg);
        assert_eq!(pool.stats().expect("stats").unique_chunks, BLOCKS);
        assert_eq!(pool.merge_backlog().new_chunks, 0);
        assert!(reads_back(&pool, "a", |b| b));
        assert!(reads_back(&pool, "b", scrambled));
        assert!(pool.verify(&|_, _| {}).expect("verify").is_clean());
        // One new chunk: under 5 % of the live ones, not due; a dense pool never is.
        let h = pool.volume("b").expect("volume");
        h.write_at(0, &vec![9u8; BS], false).expect("write");
        let b = pool.merge_backlog();
        assert_eq!(b.new_chunks, 1);
        assert!(!schedule.due(&b), "{b:?}");
        let all_new = MergeBacklog {
            new_chunks: b.live_chunks,
            ..b
        };
        assert!(schedule.due(&all_new));
        assert!(!schedule.due(&MergeBacklog {
            sparse: false,
            ..all_new
        }));
    }
}

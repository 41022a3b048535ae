//! The background garbage collection: a thread that runs the pool's GC ([`Pool::gc`], the
//! room `pool/gc.rs`, whose docs say how a GC keeps crash safety) when dead space passes a
//! threshold, or at once when a write finds the disk low on space.
//!
//! Owns: [`BackgroundGc`] and when it runs; one GC at a time is the pool's `gc_lock`.

use crate::pool::Pool;

pub use crate::pool::gc::GcReport;

/// A background thread that runs GC when dead space passes a threshold; stops when dropped.
pub struct BackgroundGc {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl BackgroundGc {
    /// Every `interval`, compact segments at least half dead if dead bytes are more than
    /// `dead_percent` of all segment bytes and more than `dead_bytes_min`. When a write finds
    /// the disk low on space ([`Pool::take_space_low`]), within a tick (200 ms) and whatever
    /// the share of dead bytes: a volume overwritten at disk speed makes gigabytes of dead
    /// space between two periodic checks.
    pub fn start(
        pool: &std::sync::Arc<Pool>,
        interval: std::time::Duration,
        dead_percent: u8,
        dead_bytes_min: u64,
    ) -> BackgroundGc {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let weak = std::sync::Arc::downgrade(pool);
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let tick = std::time::Duration::from_millis(200);
            let mut waited = std::time::Duration::ZERO;
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                std::thread::sleep(tick);
                waited += tick;
                let Some(pool) = weak.upgrade() else { return };
                let low = pool.take_space_low();
                if waited < interval && !low {
                    continue;
                }
                waited = std::time::Duration::ZERO;
                let (ratio, dead) = pool.dead_space();
                let due = ratio * 100.0 >= f64::from(dead_percent) && dead >= dead_bytes_min;
                if due || (low && dead > 0) {
                    if low {
                        tracing::info!("background gc: the pool's disk is low on space, {dead} dead bytes to reclaim");
                    }
                    match pool.gc(50) {
                        Ok(r) => tracing::info!(
                            "background gc: removed {} segments, moved {} chunks",
                            r.segments_removed,
                            r.chunks_moved
                        ),
                        Err(e) => tracing::warn!("background gc failed: {e}"),
                    }
                }
            }
        });
        BackgroundGc {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for BackgroundGc {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

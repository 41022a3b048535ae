//! A background thread of the pool (the destager, the scrub) that stops when its handle is
//! dropped.
//!
//! Invariants: the body is told to stop through the flag it is given and checks it between
//! steps; dropping the handle sets the flag, wakes the thread if it is parked, and waits for
//! it, except from the thread itself (a body may hold the pool's last reference, whose drop
//! drops the handle there).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// A running background thread; dropping it stops it.
pub struct Worker {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Worker {
    /// Run `body` on a thread named `name`; it returns when the flag it is given is set.
    pub fn spawn(
        name: &str,
        body: impl FnOnce(Arc<AtomicBool>) + Send + 'static,
    ) -> std::io::Result<Worker> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || body(flag))?;
        Ok(Worker {
            stop,
            thread: Some(thread),
        })
    }
}

impl Worker {
    /// Wake the thread if it is parked (new work for it).
    pub fn unpark(&self) {
        if let Some(t) = &self.thread {
            t.thread().unpark();
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn dropping_the_handle_stops_and_joins_the_thread() {
        let ran = Arc::new(AtomicBool::new(false));
        let seen = ran.clone();
        let w = Worker::spawn("test-worker", move |stop| {
            while !stop.load(Ordering::Relaxed) {
                std::thread::park_timeout(Duration::from_secs(60));
            }
            seen.store(true, Ordering::Relaxed);
        })
        .expect("spawning a thread");
        let started = std::time::Instant::now();
        drop(w);
        assert!(
            ran.load(Ordering::Relaxed),
            "the body ran to its end before drop returned"
        );
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "drop woke the parked thread"
        );
    }
}

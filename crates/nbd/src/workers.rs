//! A fixed pool of threads that run the blocking Volume API calls of every connection.
//!
//! Why not `tokio::task::spawn_blocking`: its pool grows to hundreds of threads and wakes one
//! per request, and on a small machine those futex wake-ups cost more than a cached 4 KiB
//! read. A few busy threads that take the next request off a shared queue without sleeping
//! keep the per-request cost down; a worker is only woken when one is idle.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

type Job = Box<dyn FnOnce() + Send + 'static>;

#[derive(Default)]
struct State {
    jobs: VecDeque<Job>,
    idle: usize,
    closed: bool,
}

struct Inner {
    state: Mutex<State>,
    wake: Condvar,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A job panicking never holds this lock (jobs run unlocked); recover regardless.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The pool. Dropping it lets the threads finish the queued jobs and exit.
pub struct Workers {
    inner: Arc<Inner>,
}

impl Workers {
    pub fn new(threads: usize) -> std::io::Result<Workers> {
        let inner = Arc::new(Inner {
            state: Mutex::new(State::default()),
            wake: Condvar::new(),
        });
        for i in 0..threads.max(1) {
            let inner = inner.clone();
            std::thread::Builder::new()
                .name(format!("condense-nbd-io-{i}"))
                .spawn(move || work(&inner))?;
        }
        Ok(Workers { inner })
    }

    /// Queue a job. Jobs must not panic across this boundary (callers catch unwinds).
    pub fn submit(&self, job: Job) {
        let mut s = self.inner.lock();
        s.jobs.push_back(job);
        let wake = s.idle > 0;
        drop(s);
        if wake {
            self.inner.wake.notify_one();
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.inner.lock().closed = true;
        self.inner.wake.notify_all();
    }
}

fn work(inner: &Inner) {
    let mut s = inner.lock();
    loop {
        if let Some(job) = s.jobs.pop_front() {
            drop(s);
            job();
            s = inner.lock();
            continue;
        }
        if s.closed {
            return;
        }
        s.idle += 1;
        s = inner.wake.wait(s).unwrap_or_else(|e| e.into_inner());
        s.idle -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn runs_every_job_and_drains_on_drop() {
        let done = Arc::new(AtomicUsize::new(0));
        let (tx, rx) = std::sync::mpsc::channel();
        {
            let w = Workers::new(3).expect("threads");
            for _ in 0..1000 {
                let done = done.clone();
                let tx = tx.clone();
                w.submit(Box::new(move || {
                    done.fetch_add(1, Ordering::SeqCst);
                    let _ = tx.send(());
                }));
            }
        }
        for _ in 0..1000 {
            rx.recv_timeout(std::time::Duration::from_secs(10))
                .expect("job ran");
        }
        assert_eq!(done.load(Ordering::SeqCst), 1000);
    }
}

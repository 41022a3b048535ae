//! The CPU and I/O priority of the threads a background pass spreads its work over, beside
//! the threads that serve the VMs.
//!
//! Owns: [`yield_to_io`] and [`background_threads`]. Invariants: only the calling thread is
//! changed (Linux keeps a niceness and an I/O priority per thread), and only ever lowered (an
//! unprivileged thread cannot raise it back). **A thread that takes the pool's state lock is
//! never lowered**: holding the lock at niceness 10 while the host's other processes (the
//! VMs' qemu, a build) keep the cores busy stretched a checkpoint's 30 ms hold past a second
//! (bench/README.md "admin-stall.sh"), every VM waiting on it. So only work done outside the
//! lock runs lowered: verify's chunk checks (read, decompress, hash).

/// The CPU niceness of a background thread (0 is the VMs', 19 the lowest).
const BACKGROUND_NICE: i32 = 10;
/// Its I/O priority: best effort, the lowest level (0 is the highest, 7 the lowest).
const BACKGROUND_IO_LEVEL: i32 = 7;

/// Make the calling thread give way to the threads serving the VMs: CPU niceness 10 and
/// best-effort I/O priority 7, so it takes the CPU and the disk's queue when the VMs leave
/// them (docs/ARCHITECTURE.md "Administration beside the VMs"). Never on a thread that
/// takes the pool's state lock (see the module docs). Not the idle classes: those can starve
/// a pass for as long as the VMs are busy. A refusal (a container without the right) is
/// logged once and changes nothing else.
pub fn yield_to_io() {
    // SAFETY: gettid takes no argument and cannot fail.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) };
    let tid_ = tid as libc::id_t;
    // SAFETY: PRIO_PROCESS with a thread id reads and sets that thread's niceness only.
    let now = unsafe { libc::getpriority(libc::PRIO_PROCESS, tid_) };
    let cpu = if now < BACKGROUND_NICE {
        // SAFETY: as above.
        unsafe { libc::setpriority(libc::PRIO_PROCESS, tid_, BACKGROUND_NICE) }
    } else {
        0
    };
    let cpu_err = (cpu != 0).then(std::io::Error::last_os_error);
    // IOPRIO_WHO_PROCESS is 1 (a thread id); the value is class << 13 | level, class 2 being
    // best effort.
    let value = (2 << 13) | BACKGROUND_IO_LEVEL;
    // SAFETY: as above, integers only.
    let io = unsafe { libc::syscall(libc::SYS_ioprio_set, 1, tid, value) };
    let io_err = (io != 0).then(std::io::Error::last_os_error);
    if let Some(e) = cpu_err.or(io_err) {
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            tracing::info!("background work runs at the VMs' priority (lowering it failed: {e})")
        });
    }
}

/// A pool of worker threads at the background priority ([`yield_to_io`]), one per core, for
/// a pass that spreads work over the cores (verify's chunk checks): the global rayon pool
/// serves the VMs' reads and writes at their priority, and a pass run there would take both
/// cores from them. Made at the first use; `None` if the threads cannot be started (the
/// caller then uses the global pool).
pub fn background_threads() -> Option<&'static rayon::ThreadPool> {
    static POOL: std::sync::OnceLock<Option<rayon::ThreadPool>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .thread_name(|i| format!("condense-bg-{i}"))
            .start_handler(|_| yield_to_io())
            .build()
            .map_err(|e| tracing::warn!("cannot start the background threads: {e}"))
            .ok()
    })
    .as_ref()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_calling_thread_is_lowered() {
        let before = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
        let inside = std::thread::spawn(|| {
            yield_to_io();
            let tid = unsafe { libc::syscall(libc::SYS_gettid) } as libc::id_t;
            let nice = unsafe { libc::getpriority(libc::PRIO_PROCESS, tid) };
            let io = unsafe { libc::syscall(libc::SYS_ioprio_get, 1, tid) };
            (nice, io)
        })
        .join()
        .expect("the thread ran");
        assert_eq!(
            inside.0,
            BACKGROUND_NICE.max(before),
            "the thread's niceness"
        );
        assert_eq!(
            inside.1,
            i64::from((2 << 13) | BACKGROUND_IO_LEVEL),
            "the thread's I/O priority"
        );
        let after = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
        assert_eq!(before, after, "the process's main thread is untouched");
    }

    #[test]
    fn the_background_threads_run_at_the_background_priority() {
        let threads = background_threads().expect("threads start");
        let nice = threads.install(|| {
            let tid = unsafe { libc::syscall(libc::SYS_gettid) } as libc::id_t;
            unsafe { libc::getpriority(libc::PRIO_PROCESS, tid) }
        });
        assert!(
            nice >= BACKGROUND_NICE,
            "a background thread's niceness: {nice}"
        );
    }
}

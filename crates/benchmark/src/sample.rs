//! CPU and memory of a process over time, from /proc/PID/stat and /proc/PID/status.
//!
//! A thread reads the process's user + system CPU ticks and its resident set size every
//! interval; each sample is labelled with the phase the benchmark was in (a job name, "idle").
//! CPU percent is of one core: 200 % means two cores busy.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct Sample {
    /// Seconds since the benchmark started.
    pub t: f64,
    /// CPU percent (of one core) since the previous sample.
    pub cpu: f64,
    pub rss: u64,
    pub phase: String,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// User + system CPU time of a process in clock ticks (fields 14 and 15 of /proc/PID/stat).
pub fn cpu_ticks(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat_ticks(&s)
}

/// The command name (field 2) may hold spaces and parentheses: fields are counted after the
/// last ')'.
pub fn parse_stat_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state): utime is field 14, stime field 15.
    let utime: u64 = f.get(11)?.parse().ok()?;
    let stime: u64 = f.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// Resident set size in bytes (VmRSS of /proc/PID/status).
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_status_rss(&s)
}

pub fn parse_status_rss(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

pub fn clock_ticks_per_second() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

pub struct Sampler {
    stop: Arc<AtomicBool>,
    phase: Arc<Mutex<String>>,
    samples: Arc<Mutex<Vec<Sample>>>,
    handle: Option<JoinHandle<()>>,
}

impl Sampler {
    /// Sample `pid` every `interval`, times measured from `t0`, starting in `phase`.
    pub fn start(pid: u32, t0: Instant, interval: Duration, phase: &str) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let phase = Arc::new(Mutex::new(phase.to_string()));
        let samples = Arc::new(Mutex::new(Vec::new()));
        let (st, ph, sa) = (stop.clone(), phase.clone(), samples.clone());
        let handle = std::thread::spawn(move || {
            let hz = clock_ticks_per_second();
            let mut prev: Option<(Instant, u64)> = cpu_ticks(pid).map(|t| (Instant::now(), t));
            while !st.load(Ordering::Relaxed) {
                std::thread::sleep(interval);
                let now = Instant::now();
                let (Some(ticks), Some(rss)) = (cpu_ticks(pid), rss_bytes(pid)) else {
                    break; // the process is gone
                };
                if let Some((pt, pticks)) = prev {
                    let dt = now.duration_since(pt).as_secs_f64();
                    if dt > 0.0 {
                        let cpu = ticks.saturating_sub(pticks) as f64 / hz / dt * 100.0;
                        let phase = lock(&ph).clone();
                        lock(&sa).push(Sample {
                            t: now.duration_since(t0).as_secs_f64(),
                            cpu,
                            rss,
                            phase,
                        });
                    }
                }
                prev = Some((now, ticks));
            }
        });
        Sampler {
            stop,
            phase,
            samples,
            handle: Some(handle),
        }
    }

    pub fn set_phase(&self, phase: &str) {
        *lock(&self.phase) = phase.to_string();
    }

    /// Stop sampling and return the samples.
    pub fn finish(mut self) -> Vec<Sample> {
        self.halt();
        std::mem::take(&mut *lock(&self.samples))
    }

    fn halt(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.halt();
    }
}

/// Resource use over one phase.
#[derive(Debug, Clone, PartialEq)]
pub struct PhaseStats {
    pub phase: String,
    pub samples: usize,
    pub cpu_avg: f64,
    pub cpu_max: f64,
    pub rss_avg: u64,
    pub rss_max: u64,
}

/// Per phase, in order of first appearance.
pub fn summarize(samples: &[Sample]) -> Vec<PhaseStats> {
    let mut order: Vec<String> = Vec::new();
    for s in samples {
        if !order.contains(&s.phase) {
            order.push(s.phase.clone());
        }
    }
    order
        .into_iter()
        .map(|p| {
            let v: Vec<&Sample> = samples.iter().filter(|s| s.phase == p).collect();
            let n = v.len().max(1);
            PhaseStats {
                samples: v.len(),
                cpu_avg: v.iter().map(|s| s.cpu).sum::<f64>() / n as f64,
                cpu_max: v.iter().map(|s| s.cpu).fold(0.0, f64::max),
                rss_avg: v.iter().map(|s| s.rss).sum::<u64>() / n as u64,
                rss_max: v.iter().map(|s| s.rss).max().unwrap_or(0),
                phase: p,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_fields() {
        let stat = "1234 (cond (x) se) S 1 2 3 4 5 6 7 8 9 10 150 25 0 0 20 0 3 0";
        assert_eq!(parse_stat_ticks(stat), Some(175));
        assert_eq!(parse_stat_ticks("garbage"), None);
        let status = "Name:\tcondense\nVmPeak:\t  9999 kB\nVmRSS:\t   2048 kB\n";
        assert_eq!(parse_status_rss(status), Some(2 << 20));
        assert_eq!(parse_status_rss("Name: x\n"), None);
    }

    #[test]
    fn samples_a_busy_process() {
        // This test process spins a thread while being sampled: CPU > 0 and RSS > 0.
        let stop = Arc::new(AtomicBool::new(false));
        let s2 = stop.clone();
        let spin = std::thread::spawn(move || {
            let mut x = 0u64;
            while !s2.load(Ordering::Relaxed) {
                x = x.wrapping_mul(31).wrapping_add(7);
                std::hint::black_box(x);
            }
        });
        let sampler = Sampler::start(
            std::process::id(),
            Instant::now(),
            Duration::from_millis(50),
            "busy",
        );
        std::thread::sleep(Duration::from_millis(400));
        sampler.set_phase("later");
        std::thread::sleep(Duration::from_millis(200));
        let samples = sampler.finish();
        stop.store(true, Ordering::Relaxed);
        let _ = spin.join();
        let sum = summarize(&samples);
        let busy = sum.iter().find(|p| p.phase == "busy");
        let Some(busy) = busy else {
            panic!("no busy phase in {sum:?}")
        };
        assert!(busy.samples >= 3, "{busy:?}");
        assert!(busy.cpu_avg > 20.0, "{busy:?}");
        assert!(busy.rss_max > 0);
        assert!(sum.iter().any(|p| p.phase == "later"));
    }

    #[test]
    fn summary_per_phase() {
        let s = |t, cpu, rss, p: &str| Sample {
            t,
            cpu,
            rss,
            phase: p.into(),
        };
        let v = vec![
            s(0.0, 10.0, 100, "idle"),
            s(0.25, 30.0, 300, "idle"),
            s(0.5, 90.0, 1000, "job"),
        ];
        let sum = summarize(&v);
        assert_eq!(sum.len(), 2);
        assert_eq!(sum[0].phase, "idle");
        assert!((sum[0].cpu_avg - 20.0).abs() < 1e-9);
        assert_eq!(sum[0].cpu_max, 30.0);
        assert_eq!(sum[0].rss_avg, 200);
        assert_eq!(sum[0].rss_max, 300);
        assert_eq!(sum[1].rss_max, 1000);
    }
}

//! The fio jobs of `condense bench`, run against a Condense volume (ioengine=nbd) or a plain
//! file, and the figures read from `fio --output-format=json`.

use crate::error::{bail, Context, Result};
use serde_json::Value;
use std::path::Path;
use std::process::Command;

/// Share of write buffers fio makes identical to an earlier one, and share of each buffer that
/// compresses: a VM disk's writes are neither all unique nor all random.
pub const DEDUPE_PERCENT: u32 = 50;
pub const COMPRESS_PERCENT: u32 = 50;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Job {
    pub name: &'static str,
    pub title: &'static str,
    pub rw: &'static str,
    pub bs: u64,
    pub iodepth: u32,
    /// Writes (with duplicate and compressible buffers, ended by a flush).
    pub writes: bool,
    /// At most this many seconds, whatever the run's job time. Every job is timed: fio wraps
    /// around the device with fresh buffers (its `loops` would repeat the same data, which a
    /// deduplicating store would rightly skip).
    pub max_seconds: Option<u64>,
}

/// Every job in the order they run. The first (sequential write) fills the device, so the read
/// jobs read written data; it is capped at 5 s because at full speed every pass leaves a
/// device's worth of garbage for the pool's GC.
pub const JOBS: &[Job] = &[
    Job {
        name: "seq-write-1m",
        title: "sequential write 1 MiB, QD4",
        rw: "write",
        bs: 1 << 20,
        iodepth: 4,
        writes: true,
        max_seconds: Some(5),
    },
    Job {
        name: "seq-read-1k",
        title: "sequential read 1 KiB, QD4",
        rw: "read",
        bs: 1024,
        iodepth: 4,
        writes: false,
        max_seconds: None,
    },
    Job {
        name: "seq-read-4k",
        title: "sequential read 4 KiB, QD4",
        rw: "read",
        bs: 4096,
        iodepth: 4,
        writes: false,
        max_seconds: None,
    },
    Job {
        name: "rand-read-1k",
        title: "random read 1 KiB, QD4",
        rw: "randread",
        bs: 1024,
        iodepth: 4,
        writes: false,
        max_seconds: None,
    },
    Job {
        name: "rand-read-4k",
        title: "random read 4 KiB, QD4",
        rw: "randread",
        bs: 4096,
        iodepth: 4,
        writes: false,
        max_seconds: None,
    },
    Job {
        name: "rand-write-4k",
        title: "random write 4 KiB, QD4",
        rw: "randwrite",
        bs: 4096,
        iodepth: 4,
        writes: true,
        max_seconds: None,
    },
    Job {
        name: "write-lat-4k",
        title: "write latency 4 KiB, QD1",
        rw: "randwrite",
        bs: 4096,
        iodepth: 1,
        writes: true,
        max_seconds: None,
    },
];

/// Where a job runs.
pub enum Target<'a> {
    /// A Condense volume through `condense serve` (nbd+unix URI).
    Nbd { uri: String },
    /// A plain file with an ordinary engine (io_uring, libaio or psync), through the page
    /// cache like Condense's own segment files.
    File { path: &'a Path, engine: &'a str },
}

#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct FioResult {
    pub bytes_per_sec: f64,
    pub iops: f64,
    /// Completion latency percentiles, microseconds.
    pub p50_us: f64,
    pub p99_us: f64,
    /// fio's own user + system CPU percent (the client side).
    pub client_cpu: f64,
}

/// The fio command line of one job.
pub fn args(job: &Job, target: &Target, size: u64, runtime_s: u64, out: &Path) -> Vec<String> {
    let mut a = vec![
        format!("--name={}", job.name),
        format!("--rw={}", job.rw),
        format!("--bs={}", job.bs),
        format!("--iodepth={}", job.iodepth),
        format!("--size={size}"),
        "--output-format=json".to_string(),
        format!("--output={}", out.display()),
    ];
    match target {
        Target::Nbd { uri } => {
            a.push("--ioengine=nbd".into());
            a.push(format!("--uri={uri}"));
        }
        Target::File { path, engine } => {
            a.push(format!("--ioengine={engine}"));
            a.push(format!("--filename={}", path.display()));
            a.push("--direct=0".into());
        }
    }
    let secs = job
        .max_seconds
        .map_or(runtime_s, |m| m.min(runtime_s))
        .max(1);
    a.push("--time_based=1".into());
    a.push(format!("--runtime={secs}"));
    if job.writes {
        a.push(format!("--dedupe_percentage={DEDUPE_PERCENT}"));
        a.push(format!("--buffer_compress_percentage={COMPRESS_PERCENT}"));
        a.push("--refill_buffers=1".into());
        a.push("--end_fsync=1".into());
    }
    a
}

/// Run one job; the JSON goes to `out`.
pub fn run(job: &Job, target: &Target, size: u64, runtime_s: u64, out: &Path) -> Result<FioResult> {
    let o = Command::new("fio")
        .args(args(job, target, size, runtime_s, out))
        .output()
        .context("cannot run fio (install it: apt-get install fio)")?;
    if !o.status.success() {
        bail!(
            "fio job {} failed ({}): {}",
            job.name,
            o.status,
            String::from_utf8_lossy(&o.stderr).trim()
        );
    }
    let text = std::fs::read_to_string(out)
        .with_context(|| format!("cannot read fio output {}", out.display()))?;
    parse(&text, job.writes).with_context(|| format!("fio output {}", out.display()))
}

fn num(v: &Value) -> f64 {
    v.as_f64().unwrap_or(0.0)
}

/// Figures of the first job in fio's JSON (anything before the first '{' is skipped: fio
/// prints some warnings there).
pub fn parse(text: &str, writes: bool) -> Result<FioResult> {
    let start = text.find('{').context("no JSON in fio output")?;
    let v: Value = serde_json::from_str(&text[start..]).context("fio output is not JSON")?;
    let job = v
        .get("jobs")
        .and_then(|j| j.get(0))
        .context("fio output has no jobs")?;
    let err = job.get("error").and_then(Value::as_i64).unwrap_or(0);
    if err != 0 {
        bail!("fio job reported error {err}");
    }
    let dir = job
        .get(if writes { "write" } else { "read" })
        .context("fio job has no read/write figures")?;
    let pct = |p: &str| {
        dir.get("clat_ns")
            .and_then(|c| c.get("percentile"))
            .and_then(|c| c.get(p))
            .map(num)
            .unwrap_or(0.0)
            / 1000.0
    };
    Ok(FioResult {
        bytes_per_sec: dir.get("bw_bytes").map(num).unwrap_or(0.0),
        iops: dir.get("iops").map(num).unwrap_or(0.0),
        p50_us: pct("50.000000"),
        p99_us: pct("99.000000"),
        client_cpu: job.get("usr_cpu").map(num).unwrap_or(0.0)
            + job.get("sys_cpu").map(num).unwrap_or(0.0),
    })
}

/// fio's version ("fio-3.33"), or None when fio is missing.
pub fn version() -> Option<String> {
    let o = Command::new("fio").arg("--version").output().ok()?;
    o.status
        .success()
        .then(|| String::from_utf8_lossy(&o.stdout).trim().to_string())
}

/// The best engine for the plain file here: io_uring (asynchronous on buffered files), else
/// libaio, else psync. Probed with a tiny job in `dir`.
pub fn plain_engine(dir: &Path) -> &'static str {
    let probe = dir.join("fio-probe");
    let mut chosen = "psync";
    for engine in ["io_uring", "libaio"] {
        let ok = Command::new("fio")
            .args([
                "--name=probe",
                &format!("--filename={}", probe.display()),
                "--size=1M",
                "--rw=read",
                &format!("--ioengine={engine}"),
                "--output=/dev/null",
            ])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        if ok {
            chosen = engine;
            break;
        }
    }
    let _ = std::fs::remove_file(&probe);
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = r#"fio: some warning
{ "fio version" : "fio-3.33",
  "jobs" : [ { "jobname" : "rand-read-4k", "error" : 0,
      "read" : { "io_bytes" : 1, "bw_bytes" : 104857600, "iops" : 25600.5,
                 "clat_ns" : { "percentile" : { "50.000000" : 12288, "99.000000" : 45056 } } },
      "write" : { "bw_bytes" : 0, "iops" : 0.0, "clat_ns" : { } },
      "usr_cpu" : 10.5, "sys_cpu" : 20.25 } ] }"#;

    #[test]
    fn parses_fio_json() -> Result<()> {
        let r = parse(SAMPLE, false)?;
        assert_eq!(r.bytes_per_sec, 104857600.0);
        assert_eq!(r.iops, 25600.5);
        assert!((r.p50_us - 12.288).abs() < 1e-9);
        assert!((r.p99_us - 45.056).abs() < 1e-9);
        assert!((r.client_cpu - 30.75).abs() < 1e-9);
        let w = parse(SAMPLE, true)?;
        assert_eq!(w.bytes_per_sec, 0.0);
        assert_eq!(w.p99_us, 0.0);
        assert!(parse("no json here", false).is_err());
        assert!(parse(&SAMPLE.replace("\"error\" : 0", "\"error\" : 5"), false).is_err());
        Ok(())
    }

    #[test]
    fn job_lines_ask_for_duplicates_compression_and_a_final_flush() {
        let out = Path::new("/tmp/x.json");
        let w = args(
            &JOBS[0],
            &Target::Nbd {
                uri: "nbd+unix:///fio?socket=/s".into(),
            },
            1 << 20,
            20,
            out,
        );
        assert!(w.contains(&"--runtime=5".to_string()));
        assert!(w.contains(&"--ioengine=nbd".to_string()));
        assert!(w.contains(&"--uri=nbd+unix:///fio?socket=/s".to_string()));
        assert!(w.contains(&format!("--dedupe_percentage={DEDUPE_PERCENT}")));
        assert!(w.contains(&"--end_fsync=1".to_string()));
        let r = args(
            &JOBS[3],
            &Target::File {
                path: Path::new("/d/plain.raw"),
                engine: "libaio",
            },
            1 << 20,
            3,
            out,
        );
        assert!(r.contains(&"--filename=/d/plain.raw".to_string()));
        assert!(r.contains(&"--runtime=3".to_string()));
        assert!(!r.iter().any(|a| a.starts_with("--dedupe")));
        // Every job the issue asks for is there.
        for (rw, bs, qd) in [
            ("read", 1024, 4),
            ("read", 4096, 4),
            ("randread", 1024, 4),
            ("randread", 4096, 4),
            ("write", 1 << 20, 4),
            ("randwrite", 4096, 4),
            ("randwrite", 4096, 1),
        ] {
            assert!(
                JOBS.iter()
                    .any(|j| j.rw == rw && j.bs == bs && j.iodepth == qd),
                "{rw} {bs} {qd}"
            );
        }
    }
}

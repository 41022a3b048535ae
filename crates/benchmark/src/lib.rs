//! The library behind `condense bench`: the experiment storage studies run to judge a dedup file system —
//! storage savings, disk performance, resource use — on the user's own hardware, Condense side
//! by side with a plain directory on the same disk.
//!
//! 1. Savings: the images (given, or a generated VM-like set) are imported into a fresh
//!    scratch pool with `condense import`, and copied with `cp --sparse=always` into a plain
//!    baseline directory; the pool's `du` against the copies' `du`.
//! 2. Performance: `condense serve --socket` runs as a child process; fio (ioengine=nbd) runs
//!    each job against a volume, then the same job (io_uring/libaio/psync) against a plain
//!    file of the same size in the baseline directory.
//! 3. Resources: CPU and RSS of the serve process every 250 ms, per job and while idle.
//! 4. A Markdown report with hand-written SVG charts in --out, and a summary on the terminal.
//!
//! With --volume NAME the user's pool is only read: the volume is exported as the baseline
//! file, served read-only, and only read jobs run. Method and reading guide: docs/BENCH.md.

pub mod error;
mod fio;
mod gen;
mod sample;
mod svg;

pub use error::{Error, Result};

use condense_api::size::human;
use error::{bail, Context};
use sample::{PhaseStats, Sample, Sampler};
use serde_json::Value;
use std::ffi::OsStr;
use std::fmt::Write as _;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// What to benchmark, where, and for how long (the options of `condense bench`).
#[derive(Debug, Clone)]
pub struct Options {
    /// Benchmark this existing volume of the pool, read-only (only the read jobs run).
    pub volume: Option<String>,
    /// Disk images to import into a scratch pool; empty: a generated VM-like set.
    pub images: Vec<PathBuf>,
    /// Plain directory for the baseline copies and the scratch pool (default: `out`).
    pub baseline: Option<PathBuf>,
    /// Where report.md, the SVG charts and fio's JSON go.
    pub out: PathBuf,
    /// Small sizes and short jobs (a smoke test).
    pub quick: bool,
    /// Size of the volume and of the plain file the fio jobs use (default 64M quick, 1G full).
    pub size: Option<u64>,
    /// Seconds per timed fio job (default 3 quick, 20 full).
    pub runtime: Option<u64>,
    /// Keep the scratch pool and baseline files.
    pub keep: bool,
}

/// What a run produced: the report on disk and a summary for the terminal.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The terminal summary (savings and fio figures), ending in a newline.
    pub summary: String,
    /// `OUT/report.md`.
    pub report_path: PathBuf,
    /// Wall-clock seconds of the whole run.
    pub seconds: u64,
}

/// Sizes and durations of one run.
struct Plan {
    images: usize,
    image_size: u64,
    dev_size: u64,
    runtime: u64,
    idle: Duration,
    interval: Duration,
}

impl Plan {
    fn new(a: &Options) -> Plan {
        let (images, image_size, dev_size, runtime, idle, interval) = if a.quick {
            (3, 32 << 20, 64 << 20, 3, 2, 100)
        } else {
            (4, 160 << 20, 1 << 30, 20, 5, 250)
        };
        Plan {
            images,
            image_size,
            dev_size: a.size.unwrap_or(dev_size),
            runtime: a.runtime.unwrap_or(runtime).max(1),
            idle: Duration::from_secs(idle),
            interval: Duration::from_millis(interval),
        }
    }
}

impl Plan {
    /// Rough worst case of segment bytes the write jobs leave behind before the pool's
    /// background GC reclaims them (overwrites at full speed, ~1/4 of it stored).
    fn garbage(&self) -> u64 {
        self.runtime.min(5) * (512 << 20) + self.runtime * (64 << 20)
    }
}

/// The scratch directory (pool, baseline, socket, logs); removed on drop unless kept.
struct Work<'a> {
    dir: PathBuf,
    keep: bool,
    log: &'a dyn Fn(&str),
}

impl Drop for Work<'_> {
    fn drop(&mut self) {
        if self.keep {
            (self.log)(&format!(
                "bench: scratch pool and baseline kept in {}",
                self.dir.display()
            ));
        } else if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            (self.log)(&format!("bench: cannot remove {}: {e}", self.dir.display()));
        }
    }
}

/// `condense serve` as a child process; stopped with SIGTERM (then SIGKILL) on drop.
struct Server {
    child: Option<Child>,
    log: PathBuf,
}

impl Server {
    fn pid(&self) -> u32 {
        self.child.as_ref().map(Child::id).unwrap_or(0)
    }

    /// Stop with SIGTERM and wait for the clean shutdown (flush); error if it failed.
    fn stop(mut self) -> Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        let status = terminate(&mut child, Duration::from_secs(120))?;
        if !status.success() {
            bail!("condense serve exited with {status}: {}", tail(&self.log));
        }
        Ok(())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = terminate(&mut child, Duration::from_secs(30));
        }
    }
}

fn terminate(child: &mut Child, grace: Duration) -> Result<std::process::ExitStatus> {
    if let Ok(pid) = i32::try_from(child.id()) {
        // SAFETY: signalling our own child process.
        unsafe { libc::kill(pid, libc::SIGTERM) };
    }
    let end = Instant::now() + grace;
    loop {
        if let Some(s) = child.try_wait().context("cannot wait for condense serve")? {
            return Ok(s);
        }
        if Instant::now() > end {
            let _ = child.kill();
            return child.wait().context("cannot wait for condense serve");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The last lines of a log file, for error messages.
fn tail(path: &Path) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(8)..].join("\n")
}

/// Run `condense --pool POOL ARGS...` to completion; its stdout.
fn condense<S: AsRef<OsStr>>(bin: &Path, pool: &Path, args: &[S]) -> Result<String> {
    let o = Command::new(bin)
        .arg("--pool")
        .arg(pool)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("cannot run {}", bin.display()))?;
    let show: Vec<String> = args
        .iter()
        .map(|a| a.as_ref().to_string_lossy().into_owned())
        .collect();
    if !o.status.success() {
        bail!(
            "`condense --pool {} {}` failed: {}",
            pool.display(),
            show.join(" "),
            String::from_utf8_lossy(&o.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&o.stdout).into_owned())
}

fn stats_json(bin: &Path, pool: &Path) -> Result<Value> {
    let out = condense(bin, pool, &["stats", "--json"])?;
    serde_json::from_str(&out).context("`condense stats --json` printed no valid JSON")
}

fn u(v: &Value, k: &str) -> u64 {
    v.get(k).and_then(Value::as_u64).unwrap_or(0)
}

fn f(v: &Value, k: &str) -> f64 {
    v.get(k).and_then(Value::as_f64).unwrap_or(0.0)
}

fn volume_stats<'a>(stats: &'a Value, name: &str) -> Option<&'a Value> {
    stats
        .get("volumes")?
        .as_array()?
        .iter()
        .find(|v| v.get("name").and_then(Value::as_str) == Some(name))
}

/// Allocated bytes of a file or a directory tree, as `du` counts them (512-byte blocks).
fn du(path: &Path) -> Result<u64> {
    let m = std::fs::symlink_metadata(path)
        .with_context(|| format!("cannot stat {}", path.display()))?;
    let mut total = m.blocks() * 512;
    if m.is_dir() {
        for e in
            std::fs::read_dir(path).with_context(|| format!("cannot list {}", path.display()))?
        {
            let e = e.with_context(|| format!("cannot list {}", path.display()))?;
            total += du(&e.path())?;
        }
    }
    Ok(total)
}

fn free_bytes(path: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs writes into the zeroed struct we pass; the path is NUL-terminated.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    let r = unsafe { libc::statvfs(c.as_ptr(), &mut s) };
    (r == 0).then(|| s.f_bavail as u64 * s.f_frsize as u64)
}

/// A volume name from a file name: letters, digits, '-', '_' and '.', unique among `used`.
fn volume_name(path: &Path, used: &mut Vec<String>) -> String {
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut base: String = stem
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    base = base.trim_start_matches('.').to_string();
    if base.is_empty() {
        base = "image".into();
    }
    let mut name = base.clone();
    let mut n = 2;
    while used.contains(&name) {
        name = format!("{base}-{n}");
        n += 1;
    }
    used.push(name.clone());
    name
}

struct SavingsRow {
    name: String,
    logical: u64,
    baseline: u64,
    condense: u64,
}

struct ImportRow {
    name: String,
    seconds: f64,
    res: Option<PhaseStats>,
}

struct Savings {
    source: String,
    rows: Vec<SavingsRow>,
    /// Baseline: `du` of the copies; Condense: `du` of the pool (or the volume's share).
    baseline_du: u64,
    condense_du: u64,
    condense_label: &'static str,
    stats: Value,
    imports: Vec<ImportRow>,
    import_secs: f64,
    copy_secs: f64,
}

struct PerfRow {
    job: fio::Job,
    condense: Option<fio::FioResult>,
    baseline: Option<fio::FioResult>,
}

struct Perf {
    rows: Vec<PerfRow>,
    engine: &'static str,
    size: u64,
    read_only: bool,
    samples: Vec<Sample>,
    phases: Vec<(f64, f64, String)>,
    /// Stats of the fio volume after the write jobs (what the written data reduced to).
    fio_volume: Option<Value>,
}

/// Run the benchmark with the `condense` executable `bin` (the scratch pool's imports and
/// `serve` run as child processes) on `pool` (only read, with `volume`). Progress lines go to
/// `say`.
pub fn run(bin: &Path, pool: &Path, args: &Options, say: &dyn Fn(&str)) -> Result<Outcome> {
    let t0 = Instant::now();
    let plan = Plan::new(args);
    let Some(fio_version) = fio::version() else {
        bail!("condense bench needs fio (apt-get install fio; scripts/install-deps.sh)");
    };
    if plan.dev_size < 4 << 20 || !plan.dev_size.is_multiple_of(4096) {
        bail!("--size must be at least 4M and a multiple of 4K");
    }
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create --out {}", args.out.display()))?;
    let fio_dir = args.out.join("fio");
    std::fs::create_dir_all(&fio_dir)
        .with_context(|| format!("cannot create {}", fio_dir.display()))?;
    let parent = args.baseline.clone().unwrap_or_else(|| args.out.clone());
    std::fs::create_dir_all(&parent)
        .with_context(|| format!("cannot create --baseline {}", parent.display()))?;
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let work = Work {
        dir: parent.join(format!(
            ".condense-bench-{}-{stamp:08x}",
            std::process::id()
        )),
        keep: args.keep,
        log: say,
    };
    std::fs::create_dir(&work.dir)
        .with_context(|| format!("cannot create scratch directory {}", work.dir.display()))?;
    let baseline_dir = work.dir.join("baseline");
    std::fs::create_dir(&baseline_dir)
        .with_context(|| format!("cannot create {}", baseline_dir.display()))?;

    let (savings, perf) = match &args.volume {
        Some(name) => {
            let s = savings_volume(bin, pool, name, &baseline_dir, say)?;
            let file = baseline_dir.join(format!("{name}.raw"));
            let size = std::fs::metadata(&file)
                .with_context(|| format!("cannot stat {}", file.display()))?
                .len();
            let p = perf(
                bin, pool, name, &file, size, true, &work.dir, &fio_dir, &plan, t0, say,
            )?;
            (s, p)
        }
        None => {
            let images = if args.images.is_empty() {
                let need =
                    plan.images as u64 * plan.image_size * 2 + plan.dev_size * 2 + plan.garbage();
                check_space(&work.dir, need)?;
                say(&format!(
                    "bench: generating {} VM-like images of {}",
                    plan.images,
                    human(plan.image_size)
                ));
                gen::generate(&work.dir.join("images"), plan.images, plan.image_size)?
            } else {
                let mut need = plan.dev_size * 2 + plan.garbage();
                for i in &args.images {
                    need += du(i)? * 2;
                }
                check_space(&work.dir, need)?;
                args.images.clone()
            };
            let source = if args.images.is_empty() {
                format!(
                    "generated: {} VM-like images of {} (35 % shared OS blocks, 20 % own data, 10 % copied inside, 10 % zeros, 25 % holes)",
                    plan.images,
                    human(plan.image_size)
                )
            } else {
                format!("images: {}", list_paths(&args.images))
            };
            let pool_dir = work.dir.join("pool");
            let s = savings_images(
                bin,
                &pool_dir,
                &images,
                &baseline_dir,
                source,
                t0,
                &plan,
                say,
            )?;
            let vol = "bench-fio";
            let file = baseline_dir.join("bench-fio.raw");
            condense(
                bin,
                &pool_dir,
                &[
                    "volume",
                    "create",
                    vol,
                    "--size",
                    &plan.dev_size.to_string(),
                ],
            )?;
            let f = std::fs::File::create(&file)
                .with_context(|| format!("cannot create {}", file.display()))?;
            f.set_len(plan.dev_size)
                .with_context(|| format!("cannot size {}", file.display()))?;
            let mut p = perf(
                bin,
                &pool_dir,
                vol,
                &file,
                plan.dev_size,
                false,
                &work.dir,
                &fio_dir,
                &plan,
                t0,
                say,
            )?;
            p.fio_volume = stats_json(bin, &pool_dir)
                .ok()
                .and_then(|s| volume_stats(&s, vol).cloned());
            (s, p)
        }
    };

    let charts = write_charts(&args.out, &savings, &perf)?;
    let report = report(
        args,
        &plan,
        &fio_version,
        &savings,
        &perf,
        &charts,
        &work.dir,
    );
    let report_path = args.out.join("report.md");
    std::fs::write(&report_path, report)
        .with_context(|| format!("cannot write {}", report_path.display()))?;
    Ok(Outcome {
        summary: summary(&savings, &perf),
        report_path,
        seconds: t0.elapsed().as_secs(),
    })
}

fn list_paths(p: &[PathBuf]) -> String {
    p.iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

fn check_space(dir: &Path, need: u64) -> Result<()> {
    if let Some(free) = free_bytes(dir) {
        if free < need + (256 << 20) {
            bail!(
                "not enough free space in {}: the benchmark needs about {}, {} is free; pass --baseline DIR on a bigger disk, a smaller --size, or --quick",
                dir.display(),
                human(need),
                human(free)
            );
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn savings_images(
    bin: &Path,
    pool: &Path,
    images: &[PathBuf],
    baseline_dir: &Path,
    source: String,
    t0: Instant,
    plan: &Plan,
    say: &dyn Fn(&str),
) -> Result<Savings> {
    condense(bin, pool, &[OsStr::new("init"), pool.as_os_str()])?;
    let mut used = vec!["bench-fio".to_string()];
    let mut imports = Vec::new();
    let mut copies = Vec::new();
    let (mut import_secs, mut copy_secs) = (0.0, 0.0);
    for img in images {
        let name = volume_name(img, &mut used);
        say(&format!("bench: importing {} as {name}", img.display()));
        let log = pool
            .parent()
            .unwrap_or(pool)
            .join(format!("import-{name}.log"));
        let logf = std::fs::File::create(&log)
            .with_context(|| format!("cannot create {}", log.display()))?;
        let start = Instant::now();
        let mut child = Command::new(bin)
            .arg("--pool")
            .arg(pool)
            .arg("import")
            .arg(img)
            .arg("--name")
            .arg(&name)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(logf)
            .spawn()
            .with_context(|| format!("cannot run {}", bin.display()))?;
        let sampler = Sampler::start(child.id(), t0, plan.interval / 2, &name);
        let status = child.wait().context("cannot wait for condense import")?;
        let seconds = start.elapsed().as_secs_f64();
        let samples = sampler.finish();
        if !status.success() {
            bail!("condense import {} failed: {}", img.display(), tail(&log));
        }
        import_secs += seconds;
        imports.push(ImportRow {
            name: name.clone(),
            seconds,
            res: sample::summarize(&samples).into_iter().next(),
        });
        // The baseline: the same file copied sparsely, made durable like the pool.
        let ext = img
            .extension()
            .map(|e| format!(".{}", e.to_string_lossy()))
            .unwrap_or_default();
        let dst = baseline_dir.join(format!("{name}{ext}"));
        let start = Instant::now();
        let o = Command::new("cp")
            .arg("--sparse=always")
            .arg(img)
            .arg(&dst)
            .output()
            .context("cannot run cp")?;
        if !o.status.success() {
            bail!(
                "cp --sparse=always {} {} failed: {}",
                img.display(),
                dst.display(),
                String::from_utf8_lossy(&o.stderr).trim()
            );
        }
        std::fs::File::open(&dst)
            .and_then(|f| f.sync_all())
            .with_context(|| format!("cannot sync {}", dst.display()))?;
        copy_secs += start.elapsed().as_secs_f64();
        copies.push((name, img.clone(), dst));
    }
    let stats = stats_json(bin, pool)?;
    let mut rows = Vec::new();
    let mut baseline_du = 0;
    for (name, img, dst) in &copies {
        let v = volume_stats(&stats, name)
            .with_context(|| format!("volume {name} missing from the pool's stats"))?;
        let b = du(dst)?;
        baseline_du += b;
        rows.push(SavingsRow {
            name: name.clone(),
            logical: std::fs::metadata(img)
                .map(|m| m.len())
                .unwrap_or_else(|_| u(v, "logical_bytes")),
            baseline: b,
            condense: u(v, "physical_bytes"),
        });
    }
    Ok(Savings {
        source,
        rows,
        baseline_du,
        condense_du: du(pool)?,
        condense_label: "du of the whole pool (data + metadata)",
        stats,
        imports,
        import_secs,
        copy_secs,
    })
}

fn savings_volume(
    bin: &Path,
    pool: &Path,
    name: &str,
    baseline_dir: &Path,
    say: &dyn Fn(&str),
) -> Result<Savings> {
    let stats = stats_json(bin, pool)?;
    let v = volume_stats(&stats, name)
        .with_context(|| {
            format!(
                "volume {name:?} not found in pool {} (see `condense volume list`)",
                pool.display()
            )
        })?
        .clone();
    let dst = baseline_dir.join(format!("{name}.raw"));
    check_space(baseline_dir, u(&v, "written_bytes") + (64 << 20))?;
    say(&format!(
        "bench: exporting volume {name} to {} as the baseline",
        dst.display()
    ));
    let start = Instant::now();
    condense(
        bin,
        pool,
        &[OsStr::new("export"), OsStr::new(name), dst.as_os_str()],
    )?;
    let copy_secs = start.elapsed().as_secs_f64();
    let b = du(&dst)?;
    Ok(Savings {
        source: format!("volume {name} of pool {} (read only)", pool.display()),
        rows: vec![SavingsRow {
            name: name.to_string(),
            logical: u(&v, "logical_bytes"),
            baseline: b,
            condense: u(&v, "physical_bytes"),
        }],
        baseline_du: b,
        condense_du: u(&v, "physical_bytes"),
        condense_label: "the volume's share of the pool (shared chunks split between their users)",
        stats,
        imports: Vec::new(),
        import_secs: 0.0,
        copy_secs,
    })
}

fn wait_ready(server: &mut Server, socket: &Path) -> Result<()> {
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(child) = server.child.as_mut() {
            if let Some(s) = child.try_wait().context("cannot wait for condense serve")? {
                bail!("condense serve exited with {s}: {}", tail(&server.log));
            }
        }
        if let Ok(mut s) = std::os::unix::net::UnixStream::connect(socket) {
            let mut magic = [0u8; 8];
            if std::io::Read::read_exact(&mut s, &mut magic).is_ok() && &magic == b"NBDMAGIC" {
                return Ok(());
            }
        }
        if Instant::now() > end {
            bail!(
                "condense serve did not answer on {} within 30 s: {}",
                socket.display(),
                tail(&server.log)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[allow(clippy::too_many_arguments)]
fn perf(
    bin: &Path,
    pool: &Path,
    volume: &str,
    plain: &Path,
    size: u64,
    read_only: bool,
    work: &Path,
    fio_dir: &Path,
    plan: &Plan,
    t0: Instant,
    say: &dyn Fn(&str),
) -> Result<Perf> {
    let socket = work.join("nbd.sock");
    let log = work.join("serve.log");
    let logf =
        std::fs::File::create(&log).with_context(|| format!("cannot create {}", log.display()))?;
    let mut cmd = Command::new(bin);
    cmd.arg("--pool")
        .arg(pool)
        .arg("serve")
        .arg("--socket")
        .arg(&socket);
    if read_only {
        cmd.arg("--read-only");
    }
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(logf)
        .spawn()
        .with_context(|| format!("cannot run {} serve", bin.display()))?;
    let mut server = Server {
        child: Some(child),
        log,
    };
    wait_ready(&mut server, &socket)?;
    let uri = format!("nbd+unix:///{volume}?socket={}", socket.display());
    let engine = fio::plain_engine(work);
    let now = |t0: Instant| t0.elapsed().as_secs_f64();
    let sampler = Sampler::start(server.pid(), t0, plan.interval, "idle (start)");
    let mut phases = Vec::new();
    let a = now(t0);
    std::thread::sleep(plan.idle);
    phases.push((a, now(t0), "idle".to_string()));
    let mut rows = Vec::new();
    for job in fio::JOBS {
        if read_only && job.writes {
            rows.push(PerfRow {
                job: *job,
                condense: None,
                baseline: None,
            });
            continue;
        }
        say(&format!("bench: {} on Condense (NBD)", job.title));
        sampler.set_phase(job.name);
        let a = now(t0);
        let c = fio::run(
            job,
            &fio::Target::Nbd { uri: uri.clone() },
            size,
            plan.runtime,
            &fio_dir.join(format!("{}-condense.json", job.name)),
        )?;
        phases.push((a, now(t0), job.name.to_string()));
        say(&format!(
            "bench: {} on the plain file ({engine})",
            job.title
        ));
        sampler.set_phase("idle (plain-file jobs)");
        let a = now(t0);
        let b = fio::run(
            job,
            &fio::Target::File {
                path: plain,
                engine,
            },
            size,
            plan.runtime,
            &fio_dir.join(format!("{}-plain.json", job.name)),
        )?;
        phases.push((a, now(t0), "plain".to_string()));
        rows.push(PerfRow {
            job: *job,
            condense: Some(c),
            baseline: Some(b),
        });
    }
    sampler.set_phase("idle (end)");
    let a = now(t0);
    std::thread::sleep(plan.idle);
    phases.push((a, now(t0), "idle".to_string()));
    let samples = sampler.finish();
    server.stop()?;
    Ok(Perf {
        rows,
        engine,
        size,
        read_only,
        samples,
        phases,
        fio_volume: None,
    })
}

const SAVINGS_SVG: &str = "savings.svg";
const THROUGHPUT_SVG: &str = "throughput.svg";
const LATENCY_SVG: &str = "latency.svg";
const RESOURCES_SVG: &str = "resources.svg";

fn mib(b: f64) -> f64 {
    b / 1048576.0
}

fn write_charts(out: &Path, s: &Savings, p: &Perf) -> Result<Vec<&'static str>> {
    let write = |name: &str, svg: String| -> Result<()> {
        let path = out.join(name);
        std::fs::write(&path, svg).with_context(|| format!("cannot write {}", path.display()))
    };
    let mut cats: Vec<String> = s.rows.iter().map(|r| r.name.clone()).collect();
    let mut base: Vec<f64> = s.rows.iter().map(|r| mib(r.baseline as f64)).collect();
    let mut cond: Vec<f64> = s.rows.iter().map(|r| mib(r.condense as f64)).collect();
    if s.rows.len() > 1 {
        cats.push("all images".into());
        base.push(mib(s.baseline_du as f64));
        cond.push(mib(s.condense_du as f64));
    }
    write(
        SAVINGS_SVG,
        svg::bars(
            "Space on disk: plain directory vs Condense",
            "MiB on disk",
            &cats,
            &[
                svg::Series {
                    label: "plain directory (du)",
                    color: svg::BASELINE_COLOR,
                    values: base,
                },
                svg::Series {
                    label: "Condense",
                    color: svg::CONDENSE_COLOR,
                    values: cond,
                },
            ],
        ),
    )?;
    let ran: Vec<&PerfRow> = p.rows.iter().filter(|r| r.condense.is_some()).collect();
    let val =
        |r: Option<fio::FioResult>, g: fn(&fio::FioResult) -> f64| r.as_ref().map(g).unwrap_or(0.0);
    write(
        THROUGHPUT_SVG,
        svg::bars(
            "Throughput: Condense over NBD vs a plain file",
            "MiB/s",
            &ran.iter()
                .map(|r| r.job.title.to_string())
                .collect::<Vec<_>>(),
            &[
                svg::Series {
                    label: "Condense (NBD)",
                    color: svg::CONDENSE_COLOR,
                    values: ran
                        .iter()
                        .map(|r| val(r.condense, |x| mib(x.bytes_per_sec)))
                        .collect(),
                },
                svg::Series {
                    label: "plain file",
                    color: svg::BASELINE_COLOR,
                    values: ran
                        .iter()
                        .map(|r| val(r.baseline, |x| mib(x.bytes_per_sec)))
                        .collect(),
                },
            ],
        ),
    )?;
    let mut lcats = Vec::new();
    let (mut lc, mut lb) = (Vec::new(), Vec::new());
    // Small-block jobs only: a 1 MiB request's latency would dwarf them.
    for r in ran.iter().filter(|r| r.job.bs <= 4096) {
        lcats.push(format!("{} p50", r.job.name));
        lc.push(val(r.condense, |x| x.p50_us));
        lb.push(val(r.baseline, |x| x.p50_us));
        lcats.push(format!("{} p99", r.job.name));
        lc.push(val(r.condense, |x| x.p99_us));
        lb.push(val(r.baseline, |x| x.p99_us));
    }
    write(
        LATENCY_SVG,
        svg::bars(
            "Completion latency of small requests (p50, p99)",
            "microseconds",
            &lcats,
            &[
                svg::Series {
                    label: "Condense (NBD)",
                    color: svg::CONDENSE_COLOR,
                    values: lc,
                },
                svg::Series {
                    label: "plain file",
                    color: svg::BASELINE_COLOR,
                    values: lb,
                },
            ],
        ),
    )?;
    let points: Vec<svg::Point> = p
        .samples
        .iter()
        .map(|s| svg::Point {
            t: s.t,
            cpu: s.cpu,
            rss: s.rss,
        })
        .collect();
    write(
        RESOURCES_SVG,
        svg::timeline(
            "condense serve: CPU and memory over the run",
            &points,
            &p.phases,
        ),
    )?;
    Ok(vec![
        SAVINGS_SVG,
        THROUGHPUT_SVG,
        LATENCY_SVG,
        RESOURCES_SVG,
    ])
}

fn pct_saved(base: u64, ours: u64) -> f64 {
    if base == 0 {
        0.0
    } else {
        100.0 * (1.0 - ours as f64 / base as f64)
    }
}

fn ratio(a: Option<fio::FioResult>, b: Option<fio::FioResult>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b.bytes_per_sec > 0.0 => {
            format!("{:.2}", a.bytes_per_sec / b.bytes_per_sec)
        }
        _ => "–".into(),
    }
}

fn rate(r: Option<fio::FioResult>) -> String {
    r.map(|r| format!("{:.1} MiB/s", mib(r.bytes_per_sec)))
        .unwrap_or_else(|| "skipped".into())
}

/// Days since 1970-01-01 to a civil date (proleptic Gregorian).
fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (
        if m <= 2 {
            yoe + era * 400 + 1
        } else {
            yoe + era * 400
        },
        m,
        d,
    )
}

fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (y, m, d) = civil((secs / 86_400) as i64);
    let r = secs % 86_400;
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02} UTC",
        r / 3600,
        r % 3600 / 60
    )
}

/// CPU model, cores, RAM, kernel; the file system and device of `dir`.
fn machine(dir: &Path) -> Vec<(String, String)> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| sample::parse_status_rss(&s.replace("MemTotal:", "VmRSS:")))
        .map(human)
        .unwrap_or_else(|| "unknown".into());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into());
    let abs = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    let fs = mounts
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Some((*f.first()?, *f.get(1)?, *f.get(2)?))
        })
        .filter(|(_, mp, _)| abs.starts_with(mp))
        .max_by_key(|(_, mp, _)| mp.len())
        .map(|(dev, mp, t)| format!("{t} on {dev} (mounted at {mp})"))
        .unwrap_or_else(|| "unknown".into());
    vec![
        ("CPU".into(), format!("{model}, {cores} cores available")),
        ("RAM".into(), mem),
        ("kernel".into(), kernel),
        ("disk".into(), fs),
    ]
}

fn cpu_rss(p: &PhaseStats) -> String {
    format!(
        "| {} | {:.1} | {:.1} | {} | {} |",
        p.phase,
        p.cpu_avg,
        p.cpu_max,
        human(p.rss_avg),
        human(p.rss_max)
    )
}

fn report(
    args: &Options,
    plan: &Plan,
    fio_version: &str,
    s: &Savings,
    p: &Perf,
    charts: &[&str],
    work: &Path,
) -> String {
    let mut o = String::new();
    let cmdline: Vec<String> = std::env::args().collect();
    let _ = writeln!(o, "# Condense bench report\n");
    let _ = writeln!(
        o,
        "{} · `{}` · {} run · condense {}\n",
        utc_now(),
        cmdline.join(" "),
        if args.quick { "quick" } else { "full" },
        env!("CARGO_PKG_VERSION")
    );
    let _ = writeln!(
        o,
        "Condense side by side with a plain directory on the same disk: how much space the same \
         images take, how fast the same fio jobs run, and what the `condense serve` process uses \
         in CPU and memory. Method and how to read the figures: docs/BENCH.md.\n"
    );
    let _ = writeln!(o, "## Setup\n\n| | |\n|---|---|");
    for (k, v) in machine(work) {
        let _ = writeln!(o, "| {k} | {v} |");
    }
    let _ = writeln!(o, "| data set | {} |", s.source);
    let _ = writeln!(
        o,
        "| pool | block size {}, default compression (LZ4), fresh pool |",
        human(u(&s.stats, "block_size"))
    );
    let _ = writeln!(
        o,
        "| fio | {fio_version}; Condense through `ioengine=nbd` on a Unix socket, plain file through `ioengine={}` (buffered, page cache like Condense's segment files) |",
        p.engine
    );
    let _ = writeln!(
        o,
        "| jobs | device {} each, {} s per timed job, sequential write at most 5 s, writes: {} % duplicate buffers, {} % compressible, flushed at the end |\n",
        human(p.size),
        plan.runtime,
        fio::DEDUPE_PERCENT,
        fio::COMPRESS_PERCENT
    );

    // Savings.
    let _ = writeln!(o, "## Storage savings\n");
    let _ = writeln!(
        o,
        "| image | logical size | plain directory (`du`) | Condense | saved vs plain |\n|---|---:|---:|---:|---:|"
    );
    for r in &s.rows {
        let _ = writeln!(
            o,
            "| {} | {} | {} | {} | {:.1} % |",
            r.name,
            human(r.logical),
            human(r.baseline),
            human(r.condense),
            pct_saved(r.baseline, r.condense)
        );
    }
    let logical: u64 = s.rows.iter().map(|r| r.logical).sum();
    let _ = writeln!(
        o,
        "| **all** | {} | {} | {} | **{:.1} %** |\n",
        human(logical),
        human(s.baseline_du),
        human(s.condense_du),
        pct_saved(s.baseline_du, s.condense_du)
    );
    let st = &s.stats;
    let _ = writeln!(
        o,
        "- Condense total: {}. Per-image Condense figures are each volume's share: a chunk \
         shared by several blocks is split between them.",
        s.condense_label
    );
    let _ = writeln!(
        o,
        "- Pool (`condense stats`): written {}, zero blocks {}, {} unique chunks; dedup saving \
         {:.1} %, compression saving {:.1} %, total saving {:.1} % of the written bytes; \
         index RAM {} ({:.0} bytes per unique chunk).",
        human(u(st, "written_bytes")),
        human(u(st, "zero_bytes")),
        u(st, "unique_chunks"),
        f(st, "dedup_saving_percent"),
        f(st, "compression_saving_percent"),
        f(st, "saving_percent"),
        human(u(st, "index_ram_bytes")),
        f(st, "ram_bytes_per_unique_chunk")
    );
    if s.imports.is_empty() {
        let _ = writeln!(
            o,
            "- Baseline made with `condense export` (sparse raw) in {:.1} s.",
            s.copy_secs
        );
    } else {
        let _ = writeln!(
            o,
            "- Time to store: `condense import` {:.1} s vs `cp --sparse=always` + fsync {:.1} s.",
            s.import_secs, s.copy_secs
        );
    }
    let _ = writeln!(o, "\n![Space on disk]({SAVINGS_SVG})\n");

    // Performance.
    let _ = writeln!(o, "## Disk performance\n");
    let _ = writeln!(
        o,
        "| job | Condense | IOPS | plain file | IOPS | Condense / plain | p50 / p99 Condense (µs) | p50 / p99 plain (µs) |\n|---|---:|---:|---:|---:|---:|---:|---:|"
    );
    for r in &p.rows {
        let lat = |x: Option<fio::FioResult>| {
            x.map(|x| format!("{:.0} / {:.0}", x.p50_us, x.p99_us))
                .unwrap_or_else(|| "–".into())
        };
        let iops = |x: Option<fio::FioResult>| {
            x.map(|x| format!("{:.0}", x.iops))
                .unwrap_or_else(|| "–".into())
        };
        let _ = writeln!(
            o,
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            r.job.title,
            rate(r.condense),
            iops(r.condense),
            rate(r.baseline),
            iops(r.baseline),
            ratio(r.condense, r.baseline),
            lat(r.condense),
            lat(r.baseline)
        );
    }
    if let Some(r) = p.rows.iter().find(|r| r.job.name == "write-lat-4k") {
        if let (Some(c), Some(b)) = (r.condense, r.baseline) {
            let _ = writeln!(
                o,
                "\n4 KiB write latency at queue depth 1: Condense p50 {:.0} µs, p99 {:.0} µs; plain file p50 {:.0} µs, p99 {:.0} µs.",
                c.p50_us, c.p99_us, b.p50_us, b.p99_us
            );
        }
    }
    if p.read_only {
        let _ = writeln!(
            o,
            "\nWrite jobs skipped: --volume benchmarks a user's volume read-only and never writes to it."
        );
    }
    if let Some(v) = &p.fio_volume {
        let _ = writeln!(
            o,
            "\nWhat fio's writes became in the pool: {} written, {} unique chunks, {} stored ({:.1} % saved).",
            human(u(v, "written_bytes")),
            u(v, "unique_chunks"),
            human(u(v, "physical_bytes")),
            f(v, "saving_percent")
        );
    }
    let _ = writeln!(
        o,
        "\n![Throughput]({THROUGHPUT_SVG})\n\n![Latency]({LATENCY_SVG})\n"
    );

    // Resources.
    let _ = writeln!(o, "## Resource use\n");
    let _ = writeln!(
        o,
        "CPU (100 % = one core) and resident memory of the `condense serve` process, sampled every {} ms from /proc.\n",
        plan.interval.as_millis()
    );
    let _ = writeln!(
        o,
        "| phase | CPU avg % | CPU max % | RSS avg | RSS max |\n|---|---:|---:|---:|---:|"
    );
    for ph in sample::summarize(&p.samples) {
        let _ = writeln!(o, "{}", cpu_rss(&ph));
    }
    if !s.imports.is_empty() {
        let _ = writeln!(
            o,
            "\n`condense import` (one process per image):\n\n| image | seconds | CPU avg % | CPU max % | RSS max |\n|---|---:|---:|---:|---:|"
        );
        for i in &s.imports {
            let (ca, cm, rm) = i
                .res
                .as_ref()
                .map(|r| {
                    (
                        format!("{:.0}", r.cpu_avg),
                        format!("{:.0}", r.cpu_max),
                        human(r.rss_max),
                    )
                })
                .unwrap_or_else(|| ("too short to sample".into(), "–".into(), "–".into()));
            let _ = writeln!(o, "| {} | {:.2} | {ca} | {cm} | {rm} |", i.name, i.seconds);
        }
    }
    let _ = writeln!(o, "\n![CPU and memory over time]({RESOURCES_SVG})\n");

    let _ = writeln!(o, "## Charts\n");
    for c in charts {
        let _ = writeln!(o, "- [{c}]({c})");
    }
    let _ = writeln!(
        o,
        "\nRaw fio output (JSON) of every job: `fio/` beside this report."
    );
    o
}

/// The table printed on the terminal at the end.
fn summary(s: &Savings, p: &Perf) -> String {
    let mut o = String::new();
    let logical: u64 = s.rows.iter().map(|r| r.logical).sum();
    let _ = writeln!(o, "\ncondense bench summary");
    let _ = writeln!(
        o,
        "{:<32} {:>14} {:>14} {:>8}",
        "", "Condense", "plain", "ratio"
    );
    let _ = writeln!(
        o,
        "{:<32} {:>14} {:>14} {:>8}",
        format!("space ({} logical)", human(logical)),
        human(s.condense_du),
        human(s.baseline_du),
        if s.baseline_du > 0 {
            format!("{:.3}", s.condense_du as f64 / s.baseline_du as f64)
        } else {
            "–".into()
        }
    );
    for r in &p.rows {
        let _ = writeln!(
            o,
            "{:<32} {:>14} {:>14} {:>8}",
            r.job.title,
            rate(r.condense),
            rate(r.baseline),
            ratio(r.condense, r.baseline)
        );
    }
    if let Some(r) = p.rows.iter().find(|r| r.job.name == "write-lat-4k") {
        if let (Some(c), Some(b)) = (r.condense, r.baseline) {
            let _ = writeln!(
                o,
                "{:<32} {:>14} {:>14}",
                "4K write latency p50 / p99",
                format!("{:.0}/{:.0} µs", c.p50_us, c.p99_us),
                format!("{:.0}/{:.0} µs", b.p50_us, b.p99_us)
            );
        }
    }
    let phases = sample::summarize(&p.samples);
    let idle: Vec<&PhaseStats> = phases
        .iter()
        .filter(|x| x.phase.starts_with("idle (s"))
        .collect();
    let busy: Vec<&PhaseStats> = phases
        .iter()
        .filter(|x| !x.phase.starts_with("idle"))
        .collect();
    if let Some(i) = idle.first() {
        let _ = writeln!(
            o,
            "{:<32} CPU {:.1} %, RSS {}",
            "condense serve idle",
            i.cpu_avg,
            human(i.rss_max)
        );
    }
    if let Some(b) = busy.iter().max_by(|a, b| a.cpu_avg.total_cmp(&b.cpu_avg)) {
        let rss = busy.iter().map(|x| x.rss_max).max().unwrap_or(0);
        let _ = writeln!(
            o,
            "{:<32} CPU {:.0} % (avg, {}), RSS max {}",
            "condense serve busiest job",
            b.cpu_avg,
            b.phase,
            human(rss)
        );
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates() {
        assert_eq!(civil(0), (1970, 1, 1));
        assert_eq!(civil(19_723), (2024, 1, 1));
        assert_eq!(civil(19_782), (2024, 2, 29));
    }

    #[test]
    fn volume_names_are_clean_and_unique() {
        let mut used = vec!["bench-fio".to_string()];
        assert_eq!(volume_name(Path::new("/x/dns1.raw"), &mut used), "dns1");
        assert_eq!(volume_name(Path::new("/y/dns1.qcow2"), &mut used), "dns1-2");
        assert_eq!(volume_name(Path::new("/y/a b.img"), &mut used), "a_b");
        assert_eq!(volume_name(Path::new("/y/.hidden"), &mut used), "hidden");
        assert_eq!(
            volume_name(Path::new("/y/bench-fio.raw"), &mut used),
            "bench-fio-2"
        );
    }

    #[test]
    fn du_counts_allocated_not_apparent_bytes() -> Result<()> {
        let d = tempfile::tempdir()?;
        let p = d.path().join("sparse");
        let f = std::fs::File::create(&p)?;
        f.set_len(64 << 20)?;
        std::os::unix::fs::FileExt::write_all_at(&f, &[1u8; 8192], 0)?;
        f.sync_all()?;
        let n = du(&p)?;
        assert!((8192..1 << 20).contains(&n), "{n}");
        assert!(du(d.path())? >= n);
        Ok(())
    }
}

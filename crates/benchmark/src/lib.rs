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
//!
//! This file runs the steps; report.rs writes report.md and the terminal summary, charts.rs the
//! SVG charts (drawn by svg.rs), fio.rs runs fio, sample.rs samples CPU and RSS, gen.rs makes
//! the generated image set.

mod charts;
pub mod error;
mod fio;
mod gen;
mod report;
mod sample;
mod svg;

pub use error::{Error, Result};

use condense_api::size::human;
use error::{bail, Context};
use sample::{PhaseStats, Sample, Sampler};
use serde_json::Value;
use std::ffi::OsStr;
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
    let dirs = Dirs::create(args, say)?;
    let (savings, perf) = match &args.volume {
        Some(name) => bench_volume(bin, pool, name, &dirs, &plan, t0, say)?,
        None => bench_images(bin, args, &dirs, &plan, t0, say)?,
    };

    let charts = charts::write_charts(&args.out, &savings, &perf)?;
    let report = report::report(
        args,
        &plan,
        &fio_version,
        &savings,
        &perf,
        &charts,
        &dirs.work.dir,
    );
    let report_path = args.out.join("report.md");
    std::fs::write(&report_path, report)
        .with_context(|| format!("cannot write {}", report_path.display()))?;
    Ok(Outcome {
        summary: report::summary(&savings, &perf),
        report_path,
        seconds: t0.elapsed().as_secs(),
    })
}

/// The directories of one run: --out, its fio/ folder, the scratch directory and the baseline
/// directory inside it.
struct Dirs<'a> {
    fio: PathBuf,
    work: Work<'a>,
    baseline: PathBuf,
}

impl<'a> Dirs<'a> {
    /// Create --out, OUT/fio and a fresh scratch directory (with baseline/) under --baseline.
    fn create(args: &Options, say: &'a dyn Fn(&str)) -> Result<Dirs<'a>> {
        std::fs::create_dir_all(&args.out)
            .with_context(|| format!("cannot create --out {}", args.out.display()))?;
        let fio = args.out.join("fio");
        std::fs::create_dir_all(&fio)
            .with_context(|| format!("cannot create {}", fio.display()))?;
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
        let baseline = work.dir.join("baseline");
        std::fs::create_dir(&baseline)
            .with_context(|| format!("cannot create {}", baseline.display()))?;
        Ok(Dirs {
            fio,
            work,
            baseline,
        })
    }
}

/// --volume NAME: export the volume as the baseline, then the read jobs on both.
fn bench_volume(
    bin: &Path,
    pool: &Path,
    name: &str,
    dirs: &Dirs,
    plan: &Plan,
    t0: Instant,
    say: &dyn Fn(&str),
) -> Result<(Savings, Perf)> {
    let s = savings_volume(bin, pool, name, &dirs.baseline, say)?;
    let file = dirs.baseline.join(format!("{name}.raw"));
    let size = std::fs::metadata(&file)
        .with_context(|| format!("cannot stat {}", file.display()))?
        .len();
    let target = PerfTarget {
        pool,
        volume: name,
        plain: &file,
        size,
        read_only: true,
    };
    let p = perf(bin, &target, dirs, plan, t0, say)?;
    Ok((s, p))
}

/// Images (given or generated): import them into a scratch pool and copy them, then every
/// fio job on a fresh volume and a plain file of the same size.
fn bench_images(
    bin: &Path,
    args: &Options,
    dirs: &Dirs,
    plan: &Plan,
    t0: Instant,
    say: &dyn Fn(&str),
) -> Result<(Savings, Perf)> {
    let (images, source) = image_set(args, &dirs.work.dir, plan, say)?;
    let pool_dir = dirs.work.dir.join("pool");
    let s = savings_images(
        bin,
        &pool_dir,
        &images,
        &dirs.baseline,
        source,
        t0,
        plan,
        say,
    )?;
    let vol = "bench-fio";
    let file = dirs.baseline.join("bench-fio.raw");
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
    let target = PerfTarget {
        pool: &pool_dir,
        volume: vol,
        plain: &file,
        size: plan.dev_size,
        read_only: false,
    };
    let mut p = perf(bin, &target, dirs, plan, t0, say)?;
    p.fio_volume = stats_json(bin, &pool_dir)
        .ok()
        .and_then(|s| volume_stats(&s, vol).cloned());
    Ok((s, p))
}

/// The images to import (generated into `work` when none were given, after checking the free
/// space either way) and how the report describes them.
fn image_set(
    args: &Options,
    work: &Path,
    plan: &Plan,
    say: &dyn Fn(&str),
) -> Result<(Vec<PathBuf>, String)> {
    let images = if args.images.is_empty() {
        let need = plan.images as u64 * plan.image_size * 2 + plan.dev_size * 2 + plan.garbage();
        check_space(work, need)?;
        say(&format!(
            "bench: generating {} VM-like images of {}",
            plan.images,
            human(plan.image_size)
        ));
        gen::generate(&work.join("images"), plan.images, plan.image_size)?
    } else {
        let mut need = plan.dev_size * 2 + plan.garbage();
        for i in &args.images {
            need += du(i)? * 2;
        }
        check_space(work, need)?;
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
    Ok((images, source))
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

/// Import every image into a fresh pool at `pool` and copy it sparsely into `baseline_dir`;
/// the space each takes.
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
        let row = import(bin, pool, img, &name, t0, plan)?;
        import_secs += row.seconds;
        imports.push(row);
        let ext = img
            .extension()
            .map(|e| format!(".{}", e.to_string_lossy()))
            .unwrap_or_default();
        let dst = baseline_dir.join(format!("{name}{ext}"));
        copy_secs += copy_sparse(img, &dst)?;
        copies.push((name, img.clone(), dst));
    }
    let stats = stats_json(bin, pool)?;
    let (rows, baseline_du) = savings_rows(&stats, &copies)?;
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

/// `condense import IMG --name NAME` into `pool`, timed and sampled (CPU, RSS).
fn import(
    bin: &Path,
    pool: &Path,
    img: &Path,
    name: &str,
    t0: Instant,
    plan: &Plan,
) -> Result<ImportRow> {
    let log = pool
        .parent()
        .unwrap_or(pool)
        .join(format!("import-{name}.log"));
    let logf =
        std::fs::File::create(&log).with_context(|| format!("cannot create {}", log.display()))?;
    let start = Instant::now();
    let mut child = Command::new(bin)
        .arg("--pool")
        .arg(pool)
        .arg("import")
        .arg(img)
        .arg("--name")
        .arg(name)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(logf)
        .spawn()
        .with_context(|| format!("cannot run {}", bin.display()))?;
    let sampler = Sampler::start(child.id(), t0, plan.interval / 2, name);
    let status = child.wait().context("cannot wait for condense import")?;
    let seconds = start.elapsed().as_secs_f64();
    let samples = sampler.finish();
    if !status.success() {
        bail!("condense import {} failed: {}", img.display(), tail(&log));
    }
    Ok(ImportRow {
        name: name.to_string(),
        seconds,
        res: sample::summarize(&samples).into_iter().next(),
    })
}

/// The baseline of one image: the same file copied sparsely, made durable like the pool; the
/// seconds it took.
fn copy_sparse(img: &Path, dst: &Path) -> Result<f64> {
    let start = Instant::now();
    let o = Command::new("cp")
        .arg("--sparse=always")
        .arg(img)
        .arg(dst)
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
    std::fs::File::open(dst)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("cannot sync {}", dst.display()))?;
    Ok(start.elapsed().as_secs_f64())
}

/// One savings row per (volume name, image, baseline copy), and the copies' total `du`.
fn savings_rows(
    stats: &Value,
    copies: &[(String, PathBuf, PathBuf)],
) -> Result<(Vec<SavingsRow>, u64)> {
    let mut rows = Vec::new();
    let mut baseline_du = 0;
    for (name, img, dst) in copies {
        let v = volume_stats(stats, name)
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
    Ok((rows, baseline_du))
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

/// Where the fio jobs run: a volume of `pool` and a plain file of `size` bytes.
struct PerfTarget<'a> {
    pool: &'a Path,
    volume: &'a str,
    plain: &'a Path,
    size: u64,
    /// Only the read jobs (and `serve --read-only`).
    read_only: bool,
}

/// Serve the pool, then idle, every fio job on Condense and on the plain file, idle again,
/// sampling the serve process throughout.
fn perf(
    bin: &Path,
    target: &PerfTarget,
    dirs: &Dirs,
    plan: &Plan,
    t0: Instant,
    say: &dyn Fn(&str),
) -> Result<Perf> {
    let work = &dirs.work.dir;
    let socket = work.join("nbd.sock");
    let server = start_server(bin, target, work, &socket)?;
    let uri = format!("nbd+unix:///{}?socket={}", target.volume, socket.display());
    let engine = fio::plain_engine(work);
    let sampler = Sampler::start(server.pid(), t0, plan.interval, "idle (start)");
    let mut phases = Vec::new();
    idle(plan, t0, &mut phases);
    let mut rows = Vec::new();
    for job in fio::JOBS {
        if target.read_only && job.writes {
            rows.push(PerfRow {
                job: *job,
                condense: None,
                baseline: None,
            });
            continue;
        }
        let jobs = JobRun {
            job,
            uri: &uri,
            engine,
            target,
            fio_dir: &dirs.fio,
            plan,
            t0,
        };
        rows.push(jobs.run(&sampler, &mut phases, say)?);
    }
    sampler.set_phase("idle (end)");
    idle(plan, t0, &mut phases);
    let samples = sampler.finish();
    server.stop()?;
    Ok(Perf {
        rows,
        engine,
        size: target.size,
        read_only: target.read_only,
        samples,
        phases,
        fio_volume: None,
    })
}

/// Seconds since the run started.
fn since(t0: Instant) -> f64 {
    t0.elapsed().as_secs_f64()
}

/// Let the server idle for the plan's idle time, recorded as an "idle" phase.
fn idle(plan: &Plan, t0: Instant, phases: &mut Vec<(f64, f64, String)>) {
    let a = since(t0);
    std::thread::sleep(plan.idle);
    phases.push((a, since(t0), "idle".to_string()));
}

/// `condense serve --socket` on the target's pool (read-only if asked), answering NBD.
fn start_server(bin: &Path, target: &PerfTarget, work: &Path, socket: &Path) -> Result<Server> {
    let log = work.join("serve.log");
    let logf =
        std::fs::File::create(&log).with_context(|| format!("cannot create {}", log.display()))?;
    let mut cmd = Command::new(bin);
    cmd.arg("--pool")
        .arg(target.pool)
        .arg("serve")
        .arg("--socket")
        .arg(socket);
    if target.read_only {
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
    wait_ready(&mut server, socket)?;
    Ok(server)
}

/// One fio job, to be run on Condense over NBD and then on the plain file.
struct JobRun<'a> {
    job: &'a fio::Job,
    uri: &'a str,
    engine: &'static str,
    target: &'a PerfTarget<'a>,
    fio_dir: &'a Path,
    plan: &'a Plan,
    t0: Instant,
}

impl JobRun<'_> {
    /// Both runs of the job, each recorded as a phase (the plain-file one as "plain").
    fn run(
        &self,
        sampler: &Sampler,
        phases: &mut Vec<(f64, f64, String)>,
        say: &dyn Fn(&str),
    ) -> Result<PerfRow> {
        let job = self.job;
        say(&format!("bench: {} on Condense (NBD)", job.title));
        sampler.set_phase(job.name);
        let a = since(self.t0);
        let c = self.fio(
            &fio::Target::Nbd {
                uri: self.uri.to_string(),
            },
            "condense",
        )?;
        phases.push((a, since(self.t0), job.name.to_string()));
        say(&format!(
            "bench: {} on the plain file ({})",
            job.title, self.engine
        ));
        sampler.set_phase("idle (plain-file jobs)");
        let a = since(self.t0);
        let b = self.fio(
            &fio::Target::File {
                path: self.target.plain,
                engine: self.engine,
            },
            "plain",
        )?;
        phases.push((a, since(self.t0), "plain".to_string()));
        Ok(PerfRow {
            job: *job,
            condense: Some(c),
            baseline: Some(b),
        })
    }

    /// fio on `target`, its JSON kept as OUT/fio/JOB-WHICH.json.
    fn fio(&self, target: &fio::Target, which: &str) -> Result<fio::FioResult> {
        fio::run(
            self.job,
            target,
            self.target.size,
            self.plan.runtime,
            &self.fio_dir.join(format!("{}-{which}.json", self.job.name)),
        )
    }
}

fn mib(b: f64) -> f64 {
    b / 1048576.0
}

#[cfg(test)]
mod tests {
    use super::*;

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

//! What a bench run tells: report.md (setup, storage savings, disk performance, resource use,
//! chart links) and the summary printed on the terminal. Only formats what the run measured;
//! the sections and how to read them: docs/BENCH.md.

use super::charts::{LATENCY_SVG, RESOURCES_SVG, SAVINGS_SVG, THROUGHPUT_SVG};
use super::sample::{self, PhaseStats};
use super::{f, fio, mib, u, Options, Perf, Plan, Savings};
use condense_api::size::human;
use std::fmt::Write as _;
use std::path::Path;

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

/// report.md: the header, then the setup, savings, performance, resource and chart sections.
pub(crate) fn report(
    args: &Options,
    plan: &Plan,
    fio_version: &str,
    s: &Savings,
    p: &Perf,
    charts: &[&str],
    work: &Path,
) -> String {
    let mut o = String::new();
    title(&mut o, args);
    setup(&mut o, plan, fio_version, s, p, work);
    savings(&mut o, s);
    performance(&mut o, p);
    resources(&mut o, plan, s, p);
    chart_list(&mut o, charts);
    o
}

/// The title, when and how the run was made, and what the report compares.
fn title(o: &mut String, args: &Options) {
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
}

/// "## Setup": the machine, the data set, the pool, fio and the jobs.
fn setup(o: &mut String, plan: &Plan, fio_version: &str, s: &Savings, p: &Perf, work: &Path) {
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
}

/// "## Storage savings": the per-image table and the pool's own figures.
fn savings(o: &mut String, s: &Savings) {
    let _ = writeln!(o, "## Storage savings\n");
    savings_table(o, s);
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
}

/// One row per image and a total row: logical size, plain `du`, Condense, saving.
fn savings_table(o: &mut String, s: &Savings) {
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
}

/// "## Disk performance": the fio table, 4K write latency, what fio's writes became.
fn performance(o: &mut String, p: &Perf) {
    let _ = writeln!(o, "## Disk performance\n");
    perf_table(o, p);
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
}

/// One row per fio job: throughput, IOPS, ratio and latency on Condense and the plain file.
fn perf_table(o: &mut String, p: &Perf) {
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
}

/// "## Resource use": CPU and RSS of serve per phase, and of each import.
fn resources(o: &mut String, plan: &Plan, s: &Savings, p: &Perf) {
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
        imports_table(o, s);
    }
    let _ = writeln!(o, "\n![CPU and memory over time]({RESOURCES_SVG})\n");
}

/// One row per `condense import`: seconds, CPU, peak RSS.
fn imports_table(o: &mut String, s: &Savings) {
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

/// "## Charts": links to the SVG files and to fio's raw output.
fn chart_list(o: &mut String, charts: &[&str]) {
    let _ = writeln!(o, "## Charts\n");
    for c in charts {
        let _ = writeln!(o, "- [{c}]({c})");
    }
    let _ = writeln!(
        o,
        "\nRaw fio output (JSON) of every job: `fio/` beside this report."
    );
}

/// The table printed on the terminal at the end.
pub(crate) fn summary(s: &Savings, p: &Perf) -> String {
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
}

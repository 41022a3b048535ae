//! `condense bench` end to end, with the real fio: the quick run produces a complete report
//! (every section, every chart it links, sensible figures), and --volume never writes to the
//! user's pool.
//!
//! Skipped (with the reason printed) only when fio is missing and $CI is not "true"; in CI a
//! missing fio fails the test.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_condense");

fn have_fio() -> bool {
    Command::new("fio")
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// False (and prints why) when the test must be skipped.
fn fio_or_skip() -> bool {
    if have_fio() {
        return true;
    }
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("fio is missing in CI: run scripts/install-deps.sh");
    }
    eprintln!("SKIPPED: fio is not installed (apt-get install fio); set CI=true to make this fail");
    false
}

fn tmp() -> tempfile::TempDir {
    let base = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    match tempfile::tempdir_in(base) {
        Ok(d) => d,
        Err(e) => panic!("tempdir: {e}"),
    }
}

fn run(args: &[&str]) -> Output {
    match Command::new(BIN).args(args).output() {
        Ok(o) => o,
        Err(e) => panic!("cannot run condense: {e}"),
    }
}

fn ok(args: &[&str]) -> String {
    let o = run(args);
    assert!(
        o.status.success(),
        "condense {args:?} failed: {}\n{}",
        String::from_utf8_lossy(&o.stderr),
        String::from_utf8_lossy(&o.stdout)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn read(p: &Path) -> String {
    match std::fs::read_to_string(p) {
        Ok(s) => s,
        Err(e) => panic!("cannot read {}: {e}", p.display()),
    }
}

/// The cells of the Markdown table row whose first cell is `first`.
fn row<'a>(report: &'a str, first: &str) -> Vec<&'a str> {
    let Some(line) = report
        .lines()
        .find(|l| l.split('|').nth(1).map(str::trim) == Some(first))
    else {
        panic!("no table row {first:?} in the report:\n{report}")
    };
    line.split('|').map(str::trim).collect()
}

/// "123.4 MiB/s" → 123.4
fn mibs(cell: &str) -> f64 {
    match cell.trim_end_matches(" MiB/s").parse() {
        Ok(v) => v,
        Err(_) => panic!("not a rate: {cell:?}"),
    }
}

/// Every `](NAME.svg)` link of the report points to an SVG file beside it.
fn check_charts(out: &Path, report: &str) -> Vec<String> {
    let mut names = Vec::new();
    for piece in report.split("](").skip(1) {
        if let Some(end) = piece.find(')') {
            let target = &piece[..end];
            if target.ends_with(".svg") {
                names.push(target.to_string());
            }
        }
    }
    names.sort();
    names.dedup();
    for n in &names {
        let svg = read(&out.join(n));
        assert!(
            svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"),
            "{n} is not an SVG document"
        );
        assert!(!svg.contains("NaN"), "{n} has NaN coordinates");
    }
    names
}

#[test]
fn quick_bench_writes_a_complete_report() {
    if !fio_or_skip() {
        return;
    }
    let dir = tmp();
    let out = dir.path().join("report");
    let out_s = out.to_string_lossy().into_owned();
    // One second per fio job (3 by default with --quick): every job still runs on both sides.
    let stdout = ok(&["bench", "--quick", "--runtime", "1", "--out", &out_s]);
    assert!(stdout.contains("condense bench summary"), "{stdout}");

    let report = read(&out.join("report.md"));
    for section in [
        "## Setup",
        "## Storage savings",
        "## Disk performance",
        "## Resource use",
        "## Charts",
    ] {
        assert!(report.contains(section), "missing {section}:\n{report}");
    }
    let charts = check_charts(&out, &report);
    for c in [
        "savings.svg",
        "throughput.svg",
        "latency.svg",
        "resources.svg",
    ] {
        assert!(charts.iter().any(|n| n == c), "{c} not referenced");
    }

    // Savings: the generated set has shared, duplicate, zero and compressible data.
    let all = row(&report, "**all**");
    let saved: f64 = match all[5].trim_matches('*').trim_end_matches(" %").parse() {
        Ok(v) => v,
        Err(_) => panic!("bad saving cell {:?}", all[5]),
    };
    assert!(saved > 20.0 && saved < 100.0, "saving {saved}");

    // Performance: every job ran on both sides and moved data.
    for job in [
        "sequential write 1 MiB, QD4",
        "sequential read 1 KiB, QD4",
        "sequential read 4 KiB, QD4",
        "random read 1 KiB, QD4",
        "random read 4 KiB, QD4",
        "random write 4 KiB, QD4",
        "write latency 4 KiB, QD1",
    ] {
        let r = row(&report, job);
        assert!(mibs(r[2]) > 0.0, "{job}: Condense {:?}", r[2]);
        assert!(mibs(r[4]) > 0.0, "{job}: plain {:?}", r[4]);
    }
    assert!(report.contains("4 KiB write latency at queue depth 1: Condense p50"));

    // Resources: the server used CPU while reading and has memory.
    let r = row(&report, "seq-read-4k");
    let cpu: f64 = r[2].parse().unwrap_or(0.0);
    assert!(cpu > 0.0, "no CPU sampled during seq-read-4k: {r:?}");
    let idle = row(&report, "idle (start)");
    assert!(idle[5].ends_with("iB"), "{idle:?}");

    // fio's raw output is kept; the scratch pool and baseline are gone.
    assert!(out.join("fio/rand-read-4k-condense.json").exists());
    let leftovers: Vec<_> = std::fs::read_dir(&out)
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|e| {
                    e.file_name()
                        .to_string_lossy()
                        .starts_with(".condense-bench")
                })
                .collect()
        })
        .unwrap_or_default();
    assert!(leftovers.is_empty(), "scratch left behind: {leftovers:?}");
}

#[test]
fn volume_bench_only_reads_the_users_pool() {
    if !fio_or_skip() {
        return;
    }
    let dir = tmp();
    let pool = dir.path().join("pool");
    let pool_s = pool.to_string_lossy().into_owned();
    ok(&["--pool", &pool_s, "init"]);
    // A small image: text-like data twice (dedups) and a hole.
    let img = dir.path().join("disk.raw");
    let mut data = Vec::new();
    let mut i = 0u64;
    while data.len() < (4 << 20) {
        data.extend_from_slice(format!("line {i} of a log file on vm1\n").as_bytes());
        i += 1;
    }
    data.truncate(4 << 20);
    let mut bytes = data.clone();
    bytes.extend_from_slice(&data);
    bytes.resize(16 << 20, 0);
    if let Err(e) = std::fs::write(&img, &bytes) {
        panic!("write image: {e}");
    }
    let img_s = img.to_string_lossy().into_owned();
    ok(&["--pool", &pool_s, "import", &img_s, "--name", "vm1"]);
    let before = ok(&["--pool", &pool_s, "stats", "--json"]);

    let out = dir.path().join("out");
    let out_s = out.to_string_lossy().into_owned();
    ok(&[
        "--pool",
        &pool_s,
        "bench",
        "--quick",
        "--runtime",
        "1",
        "--volume",
        "vm1",
        "--out",
        &out_s,
    ]);
    let report = read(&out.join("report.md"));
    check_charts(&out, &report);
    assert!(report.contains("Write jobs skipped"), "{report}");
    assert_eq!(row(&report, "random write 4 KiB, QD4")[2], "skipped");
    assert!(mibs(row(&report, "random read 4 KiB, QD4")[2]) > 0.0);
    assert!(report.contains("| vm1 | 16.00 MiB |"), "{report}");

    // Nothing in the pool changed, and the volume still holds the image.
    let after = ok(&["--pool", &pool_s, "stats", "--json"]);
    assert_eq!(before, after);
    let back = dir.path().join("back.raw");
    let back_s = back.to_string_lossy().into_owned();
    ok(&["--pool", &pool_s, "export", "vm1", &back_s]);
    assert!(std::fs::read(&back).map(|b| b == bytes).unwrap_or(false));
}

#[test]
fn bench_of_a_missing_volume_fails_clearly() {
    if !fio_or_skip() {
        return;
    }
    let dir = tmp();
    let pool = dir.path().join("pool");
    let pool_s = pool.to_string_lossy().into_owned();
    ok(&["--pool", &pool_s, "init"]);
    let out = dir.path().join("out");
    let o = run(&[
        "--pool",
        &pool_s,
        "bench",
        "--quick",
        "--volume",
        "nope",
        "--out",
        &out.to_string_lossy(),
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("\"nope\" not found"), "{err}");
}

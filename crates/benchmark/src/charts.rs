//! The four SVG charts of the bench report, written beside report.md in --out: space on disk,
//! throughput, small-request latency, and the serve process's CPU and memory over the run.
//! Each chart only draws figures the run already measured (svg.rs draws).

use super::error::Context;
use super::{fio, mib, svg, Perf, PerfRow, Result, Savings};
use std::path::Path;

pub(crate) const SAVINGS_SVG: &str = "savings.svg";
pub(crate) const THROUGHPUT_SVG: &str = "throughput.svg";
pub(crate) const LATENCY_SVG: &str = "latency.svg";
pub(crate) const RESOURCES_SVG: &str = "resources.svg";

/// Write every chart into `out`; their file names, in the order the report lists them.
pub(crate) fn write_charts(out: &Path, s: &Savings, p: &Perf) -> Result<Vec<&'static str>> {
    let write = |name: &str, svg: String| -> Result<()> {
        let path = out.join(name);
        std::fs::write(&path, svg).with_context(|| format!("cannot write {}", path.display()))
    };
    let ran: Vec<&PerfRow> = p.rows.iter().filter(|r| r.condense.is_some()).collect();
    write(SAVINGS_SVG, savings(s))?;
    write(THROUGHPUT_SVG, throughput(&ran))?;
    write(LATENCY_SVG, latency(&ran))?;
    write(RESOURCES_SVG, resources(p))?;
    Ok(vec![
        SAVINGS_SVG,
        THROUGHPUT_SVG,
        LATENCY_SVG,
        RESOURCES_SVG,
    ])
}

/// A figure of a job's result, 0 when the job did not run there.
fn val(r: Option<fio::FioResult>, g: fn(&fio::FioResult) -> f64) -> f64 {
    r.as_ref().map(g).unwrap_or(0.0)
}

/// Space on disk per image (and for all of them), plain directory vs Condense.
fn savings(s: &Savings) -> String {
    let mut cats: Vec<String> = s.rows.iter().map(|r| r.name.clone()).collect();
    let mut base: Vec<f64> = s.rows.iter().map(|r| mib(r.baseline as f64)).collect();
    let mut cond: Vec<f64> = s.rows.iter().map(|r| mib(r.condense as f64)).collect();
    if s.rows.len() > 1 {
        cats.push("all images".into());
        base.push(mib(s.baseline_du as f64));
        cond.push(mib(s.condense_du as f64));
    }
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
    )
}

/// MiB/s of every job that ran, Condense vs the plain file.
fn throughput(ran: &[&PerfRow]) -> String {
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
    )
}

/// p50 and p99 completion latency of the small-block jobs.
fn latency(ran: &[&PerfRow]) -> String {
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
    )
}

/// CPU and RSS of `condense serve` over the run, with the phases marked.
fn resources(p: &Perf) -> String {
    let points: Vec<svg::Point> = p
        .samples
        .iter()
        .map(|s| svg::Point {
            t: s.t,
            cpu: s.cpu,
            rss: s.rss,
        })
        .collect();
    svg::timeline(
        "condense serve: CPU and memory over the run",
        &points,
        &p.phases,
    )
}

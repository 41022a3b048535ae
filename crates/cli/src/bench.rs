//! `condense bench`: the options, and printing what the `condense-benchmark` library measures
//! (method and reading guide: docs/BENCH.md).

use crate::size::parse_size;
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// Benchmark this existing volume of --pool. The pool is only read: the volume is served
    /// read-only and only the read jobs run (the pool must not be in use).
    #[arg(long, conflicts_with = "images")]
    pub volume: Option<String>,
    /// Disk images (raw, qcow2, vmdk, ...) to import into a scratch pool. Default: a generated
    /// set of VM-like images with shared, duplicate, zero and compressible regions.
    #[arg(long, num_args = 1.., value_name = "IMAGE")]
    pub images: Vec<PathBuf>,
    /// Plain directory for the baseline copies and file; the scratch pool is created beside
    /// them, on the same disk (default: inside --out). Everything is removed at the end.
    #[arg(long, value_name = "DIR")]
    pub baseline: Option<PathBuf>,
    /// Where report.md, the SVG charts and fio's JSON go.
    #[arg(long, value_name = "DIR", default_value = "condense-bench")]
    pub out: PathBuf,
    /// Small sizes and short jobs: finishes in under 2 minutes (a smoke test).
    #[arg(long)]
    pub quick: bool,
    /// Size of the volume and of the plain file the fio jobs use (default 64M quick, 1G full).
    #[arg(long, value_parser = parse_size, value_name = "SIZE")]
    pub size: Option<u64>,
    /// Seconds per timed fio job (default 3 quick, 20 full).
    #[arg(long, value_name = "SECONDS")]
    pub runtime: Option<u64>,
    /// Keep the scratch pool and baseline files (their path is printed).
    #[arg(long)]
    pub keep: bool,
}

pub fn run(pool: &Path, args: &BenchArgs) -> Result<()> {
    let bin = std::env::current_exe().context("cannot find the condense executable")?;
    let options = condense_benchmark::Options {
        volume: args.volume.clone(),
        images: args.images.clone(),
        baseline: args.baseline.clone(),
        out: args.out.clone(),
        quick: args.quick,
        size: args.size,
        runtime: args.runtime,
        keep: args.keep,
    };
    let outcome = condense_benchmark::run(&bin, pool, &options, &|line| eprintln!("{line}"))?;
    print!("{}", outcome.summary);
    println!(
        "report: {} ({} s in all)",
        outcome.report_path.display(),
        outcome.seconds
    );
    Ok(())
}

//! `condense scrub` and the background scrub of `serve` and `mount`, in an administrator's
//! terms. The work is `condense_engine::scrub`.

use crate::size;
use anyhow::{bail, Context, Result};
use clap::Args;
use condense_service::control::Ctx;
use condense_service::render::scrub::ScrubReport;
use condense_service::render::FileNames;
use std::time::Duration;

/// The default time from the end of one pass to the start of the next.
pub const DEFAULT_EVERY: &str = "7d";

/// `--scrub-rate` and `--scrub-every` of `serve` and `mount`.
#[derive(Args, Clone, Debug)]
pub struct ScrubArg {
    /// Background scrub: read and check every stored chunk at this rate, bytes per second
    /// (K/M/G suffixes), while serving; `0` turns it off. Damage found is logged and shown by
    /// `condense stats` (and the metrics) with the volumes and blocks it touches. Default 32M
    /// for a local pool; off for a pool on S3 (each pass would GET every segment) unless set.
    #[arg(long, value_name = "BYTES_PER_SEC", value_parser = size::parse_size)]
    pub scrub_rate: Option<u64>,
    /// Time from the end of one scrub pass to the start of the next (`30m`, `12h`, `7d`; `0`:
    /// back to back). The last pass's end is kept in the pool, so restarts keep the schedule.
    #[arg(long, value_name = "DURATION", default_value = DEFAULT_EVERY, value_parser = parse_duration)]
    pub scrub_every: Duration,
}

/// `30s`, `30m`, `12h`, `7d`, or plain seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = match s.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => s.split_at(i),
        None => (s, "s"),
    };
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration (e.g. 30m, 12h, 7d)"))?;
    let secs = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86400,
        _ => {
            return Err(format!(
                "{s:?}: the unit must be s, m, h or d (e.g. 12h, 7d)"
            ))
        }
    };
    n.checked_mul(secs)
        .map(Duration::from_secs)
        .ok_or_else(|| format!("{s:?} is too long"))
}

/// The long help of `condense scrub`.
pub(crate) const LONG_ABOUT: &str = "Read every stored chunk back and check it (its record \
checksum, authentication, decompression and fingerprint), as `condense verify` does for chunks, \
and name the volumes, snapshots and blocks of any damaged one.\n\n\
While `condense serve` or `condense mount` holds the pool, a scrub runs in its background at \
--scrub-rate (default 32 MiB/s for a local pool, every 7 days: --scrub-every); this command then \
starts a pass now, stops the one under way (--stop) or shows progress and results (--status). \
On a pool nobody serves, it runs a pass here at --rate (default: no limit) with a progress bar.\n\n\
A scrub only reads, with one exception: a record damaged in its segment whose valid copy is in \
the cache tier is written again from that copy (counted as healed). Other damage is reported \
(here, in `condense stats`, the metrics and the log): run `condense verify` for every block it \
touches, then `condense repair` (docs/REPAIR.md).\n\n\
Exit status: 0 no damage (or the request was taken), 3 damage found, 1 on error.";

#[derive(Args)]
pub(crate) struct ScrubCmdArgs {
    /// Show the pass under way and the last finished one; start nothing.
    #[arg(long, conflicts_with = "stop")]
    status: bool,
    /// Stop the pass under way in the serving process.
    #[arg(long)]
    stop: bool,
    /// On a pool nobody serves: bytes per second to read (K/M/G suffixes; default no limit).
    #[arg(long, value_name = "BYTES_PER_SEC", value_parser = size::parse_size)]
    rate: Option<u64>,
    /// Machine-readable output (the `scrub` object of `stats --json`, docs/STATS.md).
    #[arg(long)]
    json: bool,
}

pub(crate) fn run(ctx: &mut Ctx, a: &ScrubCmdArgs) -> Result<i32> {
    let pool = ctx.pool(a.status)?;
    let bs = pool.block_size();
    let code = if a.status {
        0
    } else if a.stop {
        if !ctx.in_daemon() {
            bail!(
                "no `condense serve` or `condense mount` holds pool {}: there is no scrub to stop",
                ctx.path.display()
            );
        }
        if !pool.stop_scrub() {
            writeln!(ctx.out, "no scrub pass is under way")?;
        } else {
            writeln!(
                ctx.out,
                "the scrub pass under way stops after its current window"
            )?;
        }
        0
    } else if ctx.in_daemon() {
        if pool.request_scrub() {
            writeln!(
                ctx.out,
                "scrub pass started in the background; `condense scrub --status` shows its progress"
            )?;
        } else {
            writeln!(ctx.out, "a scrub pass is under way already")?;
        }
        0
    } else {
        let bar = crate::image::bar(0, "scrubbing chunks");
        let pass = pool
            .scrub_pass(a.rate.unwrap_or(0), &|| true, &|p| {
                bar.set_length(p.chunks_total);
                bar.set_position(p.chunks_checked);
            })
            .with_context(|| format!("scrub of pool {} failed", ctx.path.display()))?;
        bar.finish_and_clear();
        if pass.damaged_chunks > 0 {
            3
        } else {
            0
        }
    };
    let status = pool.scrub_status();
    let named = [&status.current, &status.last]
        .into_iter()
        .flatten()
        .flat_map(|p| p.damaged_blocks.iter().map(|d| d.0.as_str()));
    let files = FileNames::of(&pool, named);
    let report = ScrubReport {
        status: &status,
        block_size: bs,
        files: &files,
    };
    if a.json || a.status || !ctx.in_daemon() {
        crate::print(ctx.out, &report, a.json)?;
    }
    ctx.done(&pool)?;
    Ok(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_in_an_administrators_units() {
        assert_eq!(parse_duration("7d"), Ok(Duration::from_secs(7 * 86400)));
        assert_eq!(parse_duration("12h"), Ok(Duration::from_secs(12 * 3600)));
        assert_eq!(parse_duration("30m"), Ok(Duration::from_secs(1800)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert!(parse_duration("7w").is_err());
        assert!(parse_duration("d").is_err());
        assert!(parse_duration("99999999999999999999d").is_err());
    }
}

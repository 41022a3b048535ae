//! What the CLI prints: every report is one type, built from the engine's answer, that is
//! `Serialize` (its JSON, for scripts; schemas in docs/STATS.md and the docs of each command)
//! and [`Report`] (its text, for people). One file per report; a report is printed from its
//! file only.
//!
//! JSON is printed through [`json_pretty`] or [`json_line`], with the keys of every object in
//! sorted order (as `serde_json`'s map keeps them), as every report has always printed them.

use serde::Serialize;
use std::collections::HashMap;

pub mod cache;
pub mod diff;
pub mod durability;
pub mod hosts;
pub mod index;
pub mod repair;
pub mod scrub;
pub mod snapshots;
pub mod stats;
pub mod verify;
pub mod volumes;

pub use condense_api::size::human;

/// A report for people.
pub trait Report: Serialize {
    /// The report as text (ends with a newline unless empty).
    fn text(&self) -> String;
}

/// `r` as indented JSON.
pub fn json_pretty<T: Serialize + ?Sized>(r: &T) -> serde_json::Result<String> {
    serde_json::to_string_pretty(&serde_json::to_value(r)?)
}

/// Write `report` to `out`: as JSON with `json` (indented with `pretty`, else on one line),
/// else as text.
pub fn write_report(
    out: &mut dyn std::io::Write,
    report: &impl Report,
    json: bool,
    pretty: bool,
) -> std::io::Result<()> {
    if !json {
        return write!(out, "{}", report.text());
    }
    let s = if pretty {
        json_pretty(report)
    } else {
        json_line(report)
    };
    writeln!(out, "{}", s.map_err(std::io::Error::other)?)
}

/// `r` as JSON on one line.
pub fn json_line<T: Serialize + ?Sized>(r: &T) -> serde_json::Result<String> {
    Ok(serde_json::to_value(r)?.to_string())
}

/// `x` rounded to two decimals, as the JSON reports give percentages and ratios.
pub fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// Seconds since the Unix epoch (0 if the clock is before it).
pub fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// When a Unix time was, in an administrator's terms ("2 h ago").
pub fn ago(unix: u64) -> String {
    let secs = now_unix().saturating_sub(unix);
    match secs {
        0..=119 => format!("{secs} s ago"),
        120..=7199 => format!("{} min ago", secs / 60),
        7200..=172_799 => format!("{} h ago", secs / 3600),
        _ => format!("{} days ago", secs / 86400),
    }
}

/// The files under `files/` of a pool's hidden `.file.N` volumes, for reports that name
/// damage by volume (empty when no such volume is named: the tree is not read then).
#[derive(Default)]
pub struct FileNames(HashMap<String, String>);

impl FileNames {
    pub fn of<'a>(pool: &condense_engine::Pool, named: impl IntoIterator<Item = &'a str>) -> Self {
        let wanted = named.into_iter().any(|v| v.starts_with(".file."));
        FileNames(if wanted {
            condense_fuse::tree::file_paths(pool, 10_000_000)
        } else {
            Default::default()
        })
    }

    pub fn none() -> FileNames {
        FileNames::default()
    }

    /// The file of volume `v` (a snapshot's `.file.N@S` names the file too).
    pub fn get(&self, v: &str) -> Option<&str> {
        let base = v.split_once('@').map_or(v, |(b, _)| b);
        self.0.get(base).map(String::as_str)
    }

    /// `v`, or `v (files/path)` for a file's volume.
    pub fn show(&self, v: &str) -> String {
        match self.get(v) {
            Some(f) => format!("{v} ({f})"),
            None => v.to_string(),
        }
    }
}

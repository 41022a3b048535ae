//! `volume list` and `volume info`, and one volume's figures as `stats` shows them.

use super::{human, round2, Report};
use condense_engine::VolumeStats;
use serde::{Serialize, Serializer};
use std::fmt::Write;

/// One volume's (or snapshot's) figures, as in `stats --json`.
#[derive(Serialize)]
pub struct Figures<'a> {
    name: &'a str,
    logical_bytes: u64,
    written_bytes: u64,
    zero_bytes: u64,
    physical_bytes: u64,
    saving_percent: f64,
    exclusive_bytes: Option<u64>,
    exclusive_chunks: Option<u64>,
    shared_bytes: Option<u64>,
    shared_chunks: Option<u64>,
    referenced_bytes: Option<u64>,
    dedup_ratio: Option<f64>,
    compression_ratio: Option<f64>,
}

impl<'a> Figures<'a> {
    pub fn of(v: &'a VolumeStats) -> Figures<'a> {
        Figures {
            name: &v.name,
            logical_bytes: v.logical_bytes,
            written_bytes: v.written_bytes,
            zero_bytes: v.zero_bytes,
            physical_bytes: v.physical_bytes,
            saving_percent: round2(v.saving_percent),
            exclusive_bytes: v.exclusive_bytes(),
            exclusive_chunks: v.space.map(|s| s.exclusive.chunks),
            shared_bytes: v.shared_bytes(),
            shared_chunks: v.space.map(|s| s.shared.chunks),
            referenced_bytes: v.space.map(|s| s.referenced().record_bytes()),
            dedup_ratio: v.dedup_ratio.map(round2),
            compression_ratio: v.compression_ratio.map(round2),
        }
    }
}

/// One volume with whether its import finished (`volume list/info --json`).
#[derive(Serialize)]
struct Listed<'a> {
    #[serde(flatten)]
    figures: Figures<'a>,
    incomplete_import: bool,
}

/// `volume list`: the volumes shown, each with whether its import was interrupted.
pub struct VolumeList<'a> {
    pub volumes: Vec<(&'a VolumeStats, bool)>,
}

impl Serialize for VolumeList<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.volumes.iter().map(|(v, importing)| Listed {
            figures: Figures::of(v),
            incomplete_import: *importing,
        }))
    }
}

impl Report for VolumeList<'_> {
    fn text(&self) -> String {
        let mut o = format!(
            "{:<24} {:>12} {:>12} {:>12} {:>8}\n",
            "NAME", "SIZE", "WRITTEN", "PHYSICAL", "SAVING"
        );
        for (v, importing) in &self.volumes {
            let _ = writeln!(
                o,
                "{:<24} {:>12} {:>12} {:>12} {:>7.1}%{}",
                v.name,
                human(v.logical_bytes),
                human(v.written_bytes),
                human(v.physical_bytes),
                v.saving_percent,
                if *importing {
                    "  (incomplete import)"
                } else {
                    ""
                }
            );
        }
        o
    }
}

/// `volume info`: one volume.
pub struct VolumeInfo<'a> {
    pub volume: &'a VolumeStats,
    pub importing: bool,
}

impl Serialize for VolumeInfo<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        Listed {
            figures: Figures::of(self.volume),
            incomplete_import: self.importing,
        }
        .serialize(s)
    }
}

impl Report for VolumeInfo<'_> {
    fn text(&self) -> String {
        let mut o = format!("volume {}\n", self.volume.name);
        volume_lines(&mut o, self.volume);
        if self.importing {
            o.push_str("  INCOMPLETE: its import was interrupted; delete it and import again\n");
        }
        o
    }
}

/// `n` bytes, or `-` when the figure is missing.
pub fn human_or_dash(n: Option<u64>) -> String {
    n.map_or_else(|| "-".to_string(), human)
}

/// A ratio as `1.23x`, or `-` when there is none.
pub fn ratio(r: Option<f64>) -> String {
    r.map_or_else(|| "-".to_string(), |r| format!("{r:.2}x"))
}

/// One volume's figures, a line each (`volume info`, `stats NAME`).
pub fn volume_lines(o: &mut String, v: &VolumeStats) {
    let rows = [
        ("logical size", human(v.logical_bytes)),
        ("written (non-zero)", human(v.written_bytes)),
        ("zero blocks written", human(v.zero_bytes)),
        ("would free if deleted", human_or_dash(v.exclusive_bytes())),
        ("shared with others", human_or_dash(v.shared_bytes())),
        (
            "own reduction",
            format!(
                "dedup {}, compression {}",
                ratio(v.dedup_ratio),
                ratio(v.compression_ratio)
            ),
        ),
        ("physical share", human(v.physical_bytes)),
        ("saving", format!("{:.1} %", v.saving_percent)),
    ];
    for (k, val) in rows {
        let _ = writeln!(o, "  {k:<24} {val}");
    }
}

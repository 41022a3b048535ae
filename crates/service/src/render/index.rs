//! `index show` and `index set`: the pool's dedup index mode (docs/STATS.md "Dedup index");
//! `index merge`: what the merge pass did.

use super::{human, Report};
use serde::Serialize;

/// The stored setting, and the index in RAM now (which follows the setting from the next
/// open on).
#[derive(Serialize)]
pub struct IndexReport {
    /// The pool's setting: "dense" or "sparse".
    pub mode: &'static str,
    /// The sparse budget in bytes (0 for dense).
    pub memory_bytes: u64,
    /// The mode of the index in RAM now (the setting's, if the index is not built yet).
    pub in_effect: String,
    /// RAM the index holds now (or will hold, if not built).
    pub ram_bytes: u64,
    /// True after `index set` changed the setting (it takes effect at the next open).
    pub changed: bool,
}

impl Report for IndexReport {
    fn text(&self) -> String {
        let setting = match self.mode {
            "sparse" => format!("sparse, {} of RAM", human(self.memory_bytes)),
            m => format!("{m} (~7.8 bytes of RAM per unique chunk)"),
        };
        let now = if self.changed {
            "; takes effect at the next open of the pool".to_string()
        } else if self.in_effect != self.mode {
            format!(
                "; the index in RAM now: {} (the setting takes effect at the next open)",
                self.in_effect
            )
        } else {
            String::new()
        };
        format!(
            "dedup index: {setting}{now}\nRAM of the index: {}\n",
            human(self.ram_bytes)
        )
    }
}

/// What `index merge` did, and the GC after it.
#[derive(Serialize)]
pub struct MergeView {
    /// Live chunks whose fingerprints were sorted.
    pub chunks_sorted: u64,
    /// Sorted runs (more than one: the sort used a scratch file past its memory).
    pub sort_runs: usize,
    /// Chunks holding the same data as an older chunk.
    pub duplicates: u64,
    /// Of those, merged (the rest changed while the pass ran).
    pub merged: u64,
    /// Bytes of the merged chunks' records: dead space for GC.
    pub record_bytes_merged: u64,
    /// The GC run after the pass (`None`: not run).
    pub gc: Option<MergeGc>,
}

#[derive(Serialize)]
pub struct MergeGc {
    pub segments_removed: u64,
    pub segment_bytes_before: u64,
    pub segment_bytes_after: u64,
}

impl MergeView {
    pub fn new(
        m: &condense_engine::pool::merge::MergeReport,
        gc: Option<&condense_engine::pool::gc::GcReport>,
    ) -> MergeView {
        MergeView {
            chunks_sorted: m.chunks_sorted,
            sort_runs: m.runs,
            duplicates: m.duplicates,
            merged: m.merged,
            record_bytes_merged: m.record_bytes_merged,
            gc: gc.map(|g| MergeGc {
                segments_removed: g.segments_removed,
                segment_bytes_before: g.bytes_before,
                segment_bytes_after: g.bytes_after,
            }),
        }
    }
}

impl Report for MergeView {
    fn text(&self) -> String {
        let mut s = format!(
            "merge: {} chunks sorted ({} run{}); {} held data an older chunk holds, {} merged ({} of records freed for GC)\n",
            self.chunks_sorted,
            self.sort_runs,
            if self.sort_runs == 1 { "" } else { "s" },
            self.duplicates,
            self.merged,
            human(self.record_bytes_merged)
        );
        match &self.gc {
            Some(g) => {
                s += &format!(
                    "gc: removed {} segments; segment bytes {} -> {}\n",
                    g.segments_removed,
                    human(g.segment_bytes_before),
                    human(g.segment_bytes_after)
                )
            }
            None if self.merged > 0 => s += "the space comes back at the next GC (condense gc)\n",
            None => {}
        }
        s
    }
}

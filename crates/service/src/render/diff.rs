//! `diff`: the extents that changed between a snapshot and a later snapshot or the volume.

use super::{human, Report};
use serde::Serialize;
use std::fmt::Write;

/// The changed extents (offset, length) of a comparison of `size_bytes` bytes.
#[derive(Serialize)]
pub struct DiffReport<'a> {
    schema: &'static str,
    from: &'a str,
    to: &'a str,
    size_bytes: u64,
    changed_bytes: u64,
    extent_count: usize,
    extents: Vec<Extent>,
}

#[derive(Serialize)]
struct Extent {
    offset: u64,
    length: u64,
}

impl<'a> DiffReport<'a> {
    /// The report of comparing `from` with `to` over `len` bytes.
    pub fn new(from: &'a str, to: &'a str, len: u64, changes: &[condense_api::Change]) -> Self {
        let extents: Vec<Extent> = changes
            .iter()
            .filter(|c| c.changed)
            .map(|c| Extent {
                offset: c.offset,
                length: c.len,
            })
            .collect();
        DiffReport {
            schema: "condense.diff/1",
            from,
            to,
            size_bytes: len,
            changed_bytes: extents.iter().map(|e| e.length).sum(),
            extent_count: extents.len(),
            extents,
        }
    }
}

impl Report for DiffReport<'_> {
    fn text(&self) -> String {
        let mut o = format!("{:>16} {:>16}\n", "OFFSET", "LENGTH");
        for e in &self.extents {
            let _ = writeln!(o, "{:>16} {:>16}", e.offset, e.length);
        }
        let _ = writeln!(
            o,
            "{} changed in {} extent{} between {} and {} (of {})",
            human(self.changed_bytes),
            self.extent_count,
            if self.extent_count == 1 { "" } else { "s" },
            self.from,
            self.to,
            human(self.size_bytes)
        );
        o
    }
}

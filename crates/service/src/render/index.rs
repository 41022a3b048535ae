//! `index show` and `index set`: the pool's dedup index mode (docs/STATS.md "Dedup index").

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

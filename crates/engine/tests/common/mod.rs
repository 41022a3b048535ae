//! Helpers shared by the engine's integration tests (each test binary includes this module
//! with `mod common;` and uses what it needs).

// Each test binary including this module uses some of its helpers.
#![allow(dead_code)]

use std::path::Path;

/// Flip one byte of the stored record of `data` in a segment of the pool at `dir` (an
/// uncompressed, unencrypted pool: a block's bytes are in its segment as written).
pub fn damage_record_of(dir: &Path, data: &[u8]) {
    for entry in std::fs::read_dir(dir).expect("list").filter_map(|e| e.ok()) {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !(name.starts_with("seg-") && name.ends_with(".dat")) {
            continue;
        }
        let mut seg = std::fs::read(entry.path()).expect("read segment");
        if let Some(at) = seg.windows(data.len()).position(|w| w == data) {
            seg[at + 100] ^= 0x5a;
            std::fs::write(entry.path(), &seg).expect("damage");
            return;
        }
    }
    panic!("no segment holds the block");
}

/// Open the pool on simulated directory `disk` with destaging and releases done by the
/// commands themselves (no background threads: a test sees their effect at once).
pub fn open_sim(
    disk: &std::sync::Arc<condense_engine::sim::SimDir>,
) -> Result<std::sync::Arc<condense_engine::Pool>, String> {
    let opts = condense_engine::OpenOptions {
        destage_in_background: false,
        release_in_background: false,
        ..Default::default()
    };
    condense_engine::Pool::open(
        std::sync::Arc::new(condense_engine::sim::SimHandle(disk.clone())),
        opts,
    )
    .map_err(|e| format!("open: {e}"))
}

/// [`open_sim`] of a pool set to the sparse dedup index of `budget` bytes first (the setting
/// takes effect at the next open, so the pool is opened, set, closed and opened again).
pub fn open_sparse(
    disk: &std::sync::Arc<condense_engine::sim::SimDir>,
    budget: u64,
) -> Result<std::sync::Arc<condense_engine::Pool>, String> {
    use condense_engine::index::{IndexSetting, SETTING_KEY};
    let pool = open_sim(disk)?;
    pool.meta_put(SETTING_KEY, Some(&IndexSetting::Sparse { budget }.encode()))
        .map_err(|e| e.to_string())?;
    pool.close().map_err(|e| e.to_string())?;
    drop(pool);
    open_sim(disk)
}

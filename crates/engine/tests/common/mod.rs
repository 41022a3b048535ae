//! Helpers shared by the engine's integration tests (each test binary includes this module
//! with `mod common;` and uses what it needs).

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

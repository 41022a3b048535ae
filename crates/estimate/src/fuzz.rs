//! Entry points of the fuzz targets `image_header` and `qemu_img_json` (`fuzz/fuzz_targets/`):
//! what `estimate` and `import` read about an untrusted image before converting it. The first
//! bytes of the file pick the format ([`crate::probe::probe`]) and the header checks
//! ([`crate::inspect::references`]) read the file's tables and names before any qemu tool
//! sees it; `qemu-img info` and `qemu-img map` print JSON about it that the image's header
//! decides (sizes, extents), which becomes the list of ranges read ([`crate::source`]). Each
//! returns whether its input parsed.

use crate::probe::{Format, Probed};

/// A whole (small) image file: probed, then its header checked as every format, as
/// `--format` lets an administrator name any of them for any file.
pub fn image_header(data: &[u8]) -> bool {
    let probed = crate::probe::probe(data);
    match probed {
        Probed::Image(f) => assert_ne!(f, Format::Raw, "raw has no magic"),
        Probed::Unsupported(name) => assert!(!name.is_empty()),
        Probed::Raw => {}
    }
    let mut parsed = false;
    for format in Format::ALL {
        let Ok(refs) = crate::inspect::references(&data, data.len() as u64, format) else {
            continue;
        };
        if format == Format::Raw {
            assert!(refs.is_empty(), "a raw file names no other file");
            continue;
        }
        for r in &refs {
            assert!(!r.to_string().is_empty());
        }
        parsed = true;
    }
    parsed
}

/// The output of `qemu-img info --output=json`, a NUL byte, then that of `qemu-img map
/// --output=json`: parsed, and the map turned into the aligned ranges `estimate` reads.
pub fn qemu_img_json(data: &[u8]) -> bool {
    let (info, map) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &b"[]"[..]),
    };
    let Ok(info) = crate::probe::parse_image_info(info, "fuzz.img") else {
        return false;
    };
    let Ok(extents) = crate::source::parse_map(map) else {
        return false;
    };
    for align in [4096, 65536] {
        let ranges = crate::source::align_merge(extents.clone(), align, info.virtual_size);
        let mut end = 0;
        for &(s, len) in &ranges {
            assert!(
                len > 0 && s % align == 0 && len % align == 0,
                "unaligned {s}+{len}"
            );
            assert!(end == 0 || s > end, "ranges overlap or touch: {ranges:?}");
            end = s
                .checked_add(len)
                .unwrap_or_else(|| panic!("range past 2^64: {s}+{len}"));
            assert!(end <= info.virtual_size.div_ceil(align).saturating_mul(align));
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Seeds of `qemu_img_json`: what qemu-img prints for a qcow2 image with data and holes.
    /// They parse, and `FUZZ_SEEDS_OUT=DIR` writes them to `DIR/qemu_img_json/`.
    #[test]
    fn fuzz_seeds_parse() -> std::io::Result<()> {
        let info = br#"{
    "children": [],
    "virtual-size": 1073741824,
    "filename": "vm.qcow2",
    "cluster-size": 65536,
    "format": "qcow2",
    "actual-size": 200704,
    "format-specific": {"type": "qcow2", "data": {"compat": "1.1", "compression-type": "zlib",
        "lazy-refcounts": false, "refcount-bits": 16, "corrupt": false, "extended-l2": false}},
    "dirty-flag": false
}"#;
        let map = br#"[{ "start": 0, "length": 65536, "depth": 0, "present": true, "zero": false, "data": true, "compressed": false, "offset": 327680},
{ "start": 65536, "length": 1048576, "depth": 0, "present": false, "zero": true, "data": false, "compressed": false},
{ "start": 1114112, "length": 12288, "depth": 0, "present": true, "zero": false, "data": true, "compressed": false, "offset": 393216},
{ "start": 1126400, "length": 1072615424, "depth": 0, "present": false, "zero": true, "data": false, "compressed": false}]"#;
        let mut seed = info.to_vec();
        seed.push(0);
        seed.extend_from_slice(map);
        assert!(qemu_img_json(&seed));
        if let Some(out) = std::env::var_os("FUZZ_SEEDS_OUT") {
            let dir = std::path::Path::new(&out).join("qemu_img_json");
            std::fs::create_dir_all(&dir)?;
            std::fs::write(dir.join("qcow2"), &seed)?;
        }
        Ok(())
    }
}

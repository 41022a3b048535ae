//! What kind of disk image a file is: raw, or a format `qemu-img` converts (by its magic), and
//! what `qemu-img info` says about one. Shared by `estimate` and by the CLI's import.

use crate::error::{Context, Result};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// True unless the file starts with the magic of an image format qemu-img converts
/// (qcow2, vmdk, vdi, vhdx, vpc): those go through `qemu-img convert`.
pub fn is_raw(path: &Path) -> Result<bool> {
    let f = File::open(path).with_context(|| format!("cannot open image {}", path.display()))?;
    let mut head = [0u8; 72];
    let n = f.read_at(&mut head, 0).unwrap_or(0);
    Ok(converted_format(&head[..n]).is_none())
}

/// The format qemu-img converts whose magic `head` (the first bytes of an image) starts with.
pub fn converted_format(h: &[u8]) -> Option<&'static str> {
    let vdi = h.len() >= 68 && u32::from_le_bytes([h[64], h[65], h[66], h[67]]) == 0xbeda_107f;
    if h.starts_with(b"QFI\xfb") {
        Some("qcow2")
    } else if h.starts_with(b"KDMV") || h.starts_with(b"# Disk DescriptorFile") {
        Some("vmdk")
    } else if h.starts_with(b"vhdxfile") {
        Some("vhdx")
    } else if h.starts_with(b"conectix") {
        Some("vpc")
    } else if vdi {
        Some("vdi")
    } else {
        None
    }
}

/// What `qemu-img info` says about an image.
#[derive(Debug, PartialEq, Eq)]
pub struct ImageInfo {
    pub format: String,
    pub virtual_size: u64,
}

/// Parse `qemu-img info --output=json`.
pub fn parse_image_info(json: &[u8]) -> Result<ImageInfo> {
    let v: serde_json::Value =
        serde_json::from_slice(json).context("qemu-img info printed invalid JSON")?;
    let virtual_size = v
        .get("virtual-size")
        .and_then(serde_json::Value::as_u64)
        .context("qemu-img info gave no virtual-size")?;
    let format = v
        .get("format")
        .and_then(serde_json::Value::as_str)
        .context("qemu-img info gave no format")?
        .to_string();
    Ok(ImageInfo {
        format,
        virtual_size,
    })
}

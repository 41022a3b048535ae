//! What kind of disk image a file is, by the magic in its first bytes, and what `qemu-img
//! info` says about one. Shared by `estimate` and by the CLI's import.
//!
//! The probe only chooses which reader to use; it never opens another file. Its answer is
//! checked by [`crate::inspect`] before any qemu tool sees the image, and a file whose first
//! bytes match no format below is raw: read directly, byte for byte, nothing else.

use crate::error::{Context, Result};

/// An image format Condense reads. Everything but raw goes through the qemu tools.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Raw,
    Qcow2,
    Vmdk,
    Vdi,
    Vhdx,
    /// VHD (Virtual PC, Hyper-V before VHDX).
    Vpc,
}

impl Format {
    pub const ALL: [Format; 6] = [
        Format::Raw,
        Format::Qcow2,
        Format::Vmdk,
        Format::Vdi,
        Format::Vhdx,
        Format::Vpc,
    ];

    /// The name qemu-img uses (`-f NAME`).
    pub fn name(self) -> &'static str {
        match self {
            Format::Raw => "raw",
            Format::Qcow2 => "qcow2",
            Format::Vmdk => "vmdk",
            Format::Vdi => "vdi",
            Format::Vhdx => "vhdx",
            Format::Vpc => "vpc",
        }
    }

    /// Parse a `--format` value (a qemu-img format name; `vhd` is accepted for vpc).
    pub fn parse(s: &str) -> std::result::Result<Format, String> {
        let lower = s.to_ascii_lowercase();
        if lower == "vhd" {
            return Ok(Format::Vpc);
        }
        Format::ALL
            .into_iter()
            .find(|f| f.name() == lower)
            .ok_or_else(|| {
                format!("unknown image format {s:?}: use raw, qcow2, vmdk, vdi, vhdx or vpc")
            })
    }

    /// Whether `qemu-img check` can check this format for consistency.
    pub fn has_check(self) -> bool {
        matches!(
            self,
            Format::Qcow2 | Format::Vmdk | Format::Vdi | Format::Vhdx
        )
    }
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What the first bytes of a file say it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probed {
    /// No known magic: a raw disk.
    Raw,
    /// The magic of a format Condense reads through qemu.
    Image(Format),
    /// The magic of an image format Condense does not read (it can name other files, and
    /// its data is not the guest's disk as stored): e.g. "qcow (version 1)", "qed".
    Unsupported(&'static str),
}

/// Bytes to read from the start of a file for [`probe`].
pub const PROBE_BYTES: usize = 72;

/// The format whose magic `h` (the first bytes of a file) starts with.
pub fn probe(h: &[u8]) -> Probed {
    let be32 = |at: usize| {
        h.get(at..at + 4)
            .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    };
    let vdi = h.len() >= 68 && u32::from_le_bytes([h[64], h[65], h[66], h[67]]) == 0xbeda_107f;
    if h.starts_with(b"QFI\xfb") {
        if be32(4) == Some(1) {
            Probed::Unsupported("qcow (version 1)")
        } else {
            Probed::Image(Format::Qcow2)
        }
    } else if h.starts_with(b"KDMV")
        || h.starts_with(b"COWD")
        || h.starts_with(b"# Disk DescriptorFile")
    {
        Probed::Image(Format::Vmdk)
    } else if h.starts_with(b"vhdxfile") {
        Probed::Image(Format::Vhdx)
    } else if h.starts_with(b"conectix") {
        Probed::Image(Format::Vpc)
    } else if vdi {
        Probed::Image(Format::Vdi)
    } else if h.starts_with(b"QED\0") {
        Probed::Unsupported("qed")
    } else {
        Probed::Raw
    }
}

/// The name of the image format whose magic `head` starts with; `None` for raw.
pub fn converted_format(head: &[u8]) -> Option<&'static str> {
    match probe(head) {
        Probed::Raw => None,
        Probed::Image(f) => Some(f.name()),
        Probed::Unsupported(name) => Some(name),
    }
}

/// What `qemu-img info` says about an image.
#[derive(Debug, PartialEq, Eq)]
pub struct ImageInfo {
    pub format: String,
    pub virtual_size: u64,
    /// The other files the image names, as qemu read them from its header: a backing file,
    /// an external data file, VMDK extents other than the image itself.
    pub references: Vec<String>,
}

/// Parse `qemu-img info --output=json` of the image `filename` (as given to qemu-img, to
/// tell a VMDK extent that is the image itself from one that is another file).
pub fn parse_image_info(json: &[u8], filename: &str) -> Result<ImageInfo> {
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
    let mut references = Vec::new();
    let str_at = |v: &serde_json::Value, key: &str| {
        v.get(key)
            .and_then(serde_json::Value::as_str)
            .map(str::to_string)
    };
    if let Some(b) = str_at(&v, "backing-filename") {
        references.push(format!("backing file {b:?}"));
    }
    let specific = v.pointer("/format-specific/data");
    if let Some(d) = specific.and_then(|d| str_at(d, "data-file")) {
        references.push(format!("external data file {d:?}"));
    }
    let extents = specific
        .and_then(|d| d.get("extents"))
        .and_then(serde_json::Value::as_array);
    for e in extents.into_iter().flatten() {
        if let Some(f) = str_at(e, "filename") {
            if f != filename && f != v.get("filename").and_then(|f| f.as_str()).unwrap_or("") {
                references.push(format!("extent file {f:?}"));
            }
        }
    }
    Ok(ImageInfo {
        format,
        virtual_size,
        references,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn magics() {
        assert_eq!(probe(b"QFI\xfb\0\0\0\x03"), Probed::Image(Format::Qcow2));
        assert_eq!(
            probe(b"QFI\xfb\0\0\0\x01"),
            Probed::Unsupported("qcow (version 1)")
        );
        assert_eq!(probe(b"KDMV\x01\0\0\0"), Probed::Image(Format::Vmdk));
        assert_eq!(probe(b"COWD\x01\0\0\0"), Probed::Image(Format::Vmdk));
        assert_eq!(
            probe(b"# Disk DescriptorFile\nversion=1\n"),
            Probed::Image(Format::Vmdk)
        );
        assert_eq!(probe(b"vhdxfile"), Probed::Image(Format::Vhdx));
        assert_eq!(probe(b"conectix"), Probed::Image(Format::Vpc));
        assert_eq!(probe(b"QED\0"), Probed::Unsupported("qed"));
        let mut vdi = [0u8; 72];
        vdi[64..68].copy_from_slice(&0xbeda_107fu32.to_le_bytes());
        assert_eq!(probe(&vdi), Probed::Image(Format::Vdi));
        assert_eq!(probe(&[0u8; 72]), Probed::Raw);
        assert_eq!(probe(b""), Probed::Raw);
        assert_eq!(converted_format(b"QFI\xfb\0\0\0\x02"), Some("qcow2"));
        assert_eq!(converted_format(&[7u8; 512]), None);
    }

    #[test]
    fn format_names() {
        assert_eq!(Format::parse("QCOW2"), Ok(Format::Qcow2));
        assert_eq!(Format::parse("vhd"), Ok(Format::Vpc));
        assert!(Format::parse("qed").is_err());
        for f in Format::ALL {
            assert_eq!(Format::parse(f.name()), Ok(f));
        }
    }

    #[test]
    fn info_names_what_the_image_refers_to() -> Result<()> {
        let info = parse_image_info(
            br#"{"virtual-size": 1073741824, "filename": "a.qcow2", "format": "qcow2",
                "backing-filename": "/etc/shadow",
                "format-specific": {"type": "qcow2", "data": {"data-file": "/dev/sda"}}}"#,
            "a.qcow2",
        )?;
        assert_eq!(info.format, "qcow2");
        assert_eq!(info.virtual_size, 1 << 30);
        assert_eq!(
            info.references,
            vec![
                "backing file \"/etc/shadow\"".to_string(),
                "external data file \"/dev/sda\"".to_string()
            ]
        );
        let vmdk = parse_image_info(
            br#"{"virtual-size": 512, "filename": "x", "format": "vmdk",
                "format-specific": {"type": "vmdk", "data": {"extents": [
                    {"filename": "x"}, {"filename": "/etc/passwd"}]}}}"#,
            "x",
        )?;
        assert_eq!(
            vmdk.references,
            vec!["extent file \"/etc/passwd\"".to_string()]
        );
        assert!(parse_image_info(b"{}", "x").is_err());
        assert!(parse_image_info(b"not json", "x").is_err());
        Ok(())
    }
}

//! What an image file's header says beyond its own bytes: the other files it names (a qcow2
//! backing file or external data file, VMDK extents and parents, VDI/VHDX/VHD parents), and
//! whether the file is as long as its header claims.
//!
//! This runs on the image before any qemu tool opens it, so that a hostile header (written by
//! whoever made the image, or by a guest into the first sector of its raw disk) cannot make a
//! qemu tool open a host file. It reads only the file it is given, at most a few MiB of
//! headers, with every offset and length from the file bounds-checked. It is not a parser of
//! the data: `qemu-img check` checks the tables, and qemu reads the guest's bytes.

use crate::error::{bail, Context, Result};
use crate::probe::Format;
use std::fs::File;
use std::os::unix::fs::FileExt;

/// Another file an image names, which a qemu tool would open to read the guest's disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reference {
    /// qcow2 backing file, or VMDK `parentFileNameHint`.
    BackingFile(String),
    /// qcow2 external data file.
    DataFile(String),
    /// An extent file of a VMDK descriptor.
    Extent(String),
    /// The parent of a VDI, VHDX or VHD differencing image.
    Parent(String),
}

impl std::fmt::Display for Reference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reference::BackingFile(n) => write!(f, "backing file {n:?}"),
            Reference::DataFile(n) => write!(f, "external data file {n:?}"),
            Reference::Extent(n) => write!(f, "extent file {n:?}"),
            Reference::Parent(n) => write!(f, "parent image {n}"),
        }
    }
}

/// The most bytes read for one header structure (a qcow2 first cluster, a VMDK descriptor,
/// a VHDX metadata table).
const HEADER_MAX: u64 = 2 << 20;

/// Where the image's bytes are read from: the file itself, or (for the fuzz target and tests)
/// its bytes in memory. Reads are positioned, so nothing depends on a file offset.
pub trait ReadAt {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()>;
}

impl ReadAt for File {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        FileExt::read_exact_at(self, buf, offset)
    }
}

impl ReadAt for &[u8] {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        let src = usize::try_from(offset)
            .ok()
            .and_then(|at| self.get(at..at.checked_add(buf.len())?))
            .ok_or(std::io::ErrorKind::UnexpectedEof)?;
        buf.copy_from_slice(src);
        Ok(())
    }
}

/// The other files the `format` image in `file` (of `len` bytes) names; an error if the
/// header is not one of `format`, is truncated, or is a variant that cannot be read alone.
pub fn references(file: &dyn ReadAt, len: u64, format: Format) -> Result<Vec<Reference>> {
    let header = Header { file, len };
    match format {
        Format::Raw => Ok(Vec::new()),
        Format::Qcow2 => qcow2(&header),
        Format::Vmdk => vmdk(&header),
        Format::Vdi => vdi(&header),
        Format::Vhdx => vhdx(&header),
        Format::Vpc => vpc(&header),
    }
}

/// Bounded reads from the image file.
struct Header<'a> {
    file: &'a dyn ReadAt,
    len: u64,
}

impl Header<'_> {
    /// `n` bytes at `offset`, all inside the file (else a "truncated" error naming `what`).
    fn read(&self, offset: u64, n: u64, what: &str) -> Result<Vec<u8>> {
        if n > HEADER_MAX {
            bail!("corrupt image: its {what} at offset {offset} would be {n} bytes, more than any real one");
        }
        if offset.checked_add(n).is_none_or(|e| e > self.len) {
            bail!(
                "the image is truncated or corrupt: its {what} ({n} bytes at offset {offset}) lies past the end of the file ({} bytes)",
                self.len
            );
        }
        let mut buf = vec![0u8; n as usize];
        self.file
            .read_exact_at(&mut buf, offset)
            .with_context(|| format!("reading the image's {what} at offset {offset}"))?;
        Ok(buf)
    }

    /// Up to `n` bytes at `offset`, fewer where the file ends.
    fn read_upto(&self, offset: u64, n: u64, what: &str) -> Result<Vec<u8>> {
        let n = n.min(self.len.saturating_sub(offset));
        self.read(offset, n, what)
    }

    /// Fail unless the file reaches `end` (a table the header places ending there).
    fn reaches(&self, start: u64, size: Option<u64>, what: &str) -> Result<()> {
        let end = size.and_then(|s| start.checked_add(s));
        match end {
            Some(e) if e <= self.len => Ok(()),
            _ => bail!(
                "the image is truncated or corrupt: its header places the {what} at offset {start}{}, past the end of the file ({} bytes)",
                size.map_or(String::new(), |s| format!(" ({s} bytes)")),
                self.len
            ),
        }
    }
}

fn be32(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4)
        .map_or(0, |x| u32::from_be_bytes([x[0], x[1], x[2], x[3]]))
}

fn be64(b: &[u8], at: usize) -> u64 {
    b.get(at..at + 8).map_or(0, |x| {
        u64::from_be_bytes([x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7]])
    })
}

fn le16(b: &[u8], at: usize) -> u16 {
    b.get(at..at + 2)
        .map_or(0, |x| u16::from_le_bytes([x[0], x[1]]))
}

fn le32(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4)
        .map_or(0, |x| u32::from_le_bytes([x[0], x[1], x[2], x[3]]))
}

fn le64(b: &[u8], at: usize) -> u64 {
    b.get(at..at + 8).map_or(0, |x| {
        u64::from_le_bytes([x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7]])
    })
}

/// A file name from an image header, as text (invalid UTF-8 shown replaced).
fn name(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// qcow2 (docs/interop/qcow2.txt in qemu): the backing file name in the header, the external
/// data file bit and its name in a header extension, and the L1 and refcount tables inside
/// the file.
fn qcow2(h: &Header) -> Result<Vec<Reference>> {
    let head = h.read(0, 104.min(h.len), "qcow2 header")?;
    if !head.starts_with(b"QFI\xfb") || head.len() < 72 {
        bail!("this is not a qcow2 image (no qcow2 header)");
    }
    let version = be32(&head, 4);
    if version != 2 && version != 3 {
        bail!("unsupported qcow2 version {version}");
    }
    let cluster_bits = be32(&head, 20);
    if !(9..=21).contains(&cluster_bits) {
        bail!("corrupt qcow2 header: cluster_bits {cluster_bits} (9 to 21 are valid)");
    }
    let cluster = 1u64 << cluster_bits;
    let mut refs = Vec::new();
    let backing_offset = be64(&head, 8);
    let backing_size = u64::from(be32(&head, 16));
    if backing_offset != 0 {
        let shown = if (1..=1023).contains(&backing_size) {
            name(&h.read(backing_offset, backing_size, "backing file name")?)
        } else {
            format!("(a name of {backing_size} bytes at offset {backing_offset})")
        };
        refs.push(Reference::BackingFile(shown));
    }
    let (incompatible, header_len) = if version == 3 {
        if head.len() < 104 {
            bail!("the image is truncated: its qcow2 version 3 header is incomplete");
        }
        (be64(&head, 72), u64::from(be32(&head, 100)))
    } else {
        (0, 72)
    };
    // Header extensions run from the end of the header to the end of the first cluster
    // (or to the backing file name, where that comes first).
    let ext_end = if backing_offset != 0 {
        backing_offset.min(cluster)
    } else {
        cluster
    };
    let mut data_file = None;
    if header_len < ext_end {
        let ext = h.read_upto(header_len, ext_end - header_len, "qcow2 header extensions")?;
        let mut at = 0usize;
        while at + 8 <= ext.len() {
            let kind = be32(&ext, at);
            let len = be32(&ext, at + 4) as usize;
            if kind == 0 {
                break;
            }
            let body = ext.get(at + 8..(at + 8).saturating_add(len));
            if kind == 0x4441_5441 {
                data_file = Some(body.map_or_else(|| "(unreadable name)".into(), name));
            }
            at = (at + 8).saturating_add(len.div_ceil(8) * 8);
        }
    }
    if incompatible & (1 << 2) != 0 || data_file.is_some() {
        refs.push(Reference::DataFile(
            data_file.unwrap_or_else(|| "(named only when opened)".into()),
        ));
    }
    let l1_entries = u64::from(be32(&head, 36));
    h.reaches(be64(&head, 40), l1_entries.checked_mul(8), "L1 table")?;
    let refcount_clusters = u64::from(be32(&head, 56));
    h.reaches(
        be64(&head, 48),
        refcount_clusters.checked_mul(cluster),
        "refcount table",
    )?;
    Ok(refs)
}

/// VMDK: only a single self-contained sparse file (monolithicSparse, streamOptimized: a
/// "KDMV" header with a capacity) is read alone. A descriptor (a text file, or a KDMV header
/// of capacity 0, which qemu reads as one) names extent files; `parentFileNameHint` names a
/// parent.
fn vmdk(h: &Header) -> Result<Vec<Reference>> {
    let head = h.read_upto(0, 512, "VMDK header")?;
    if head.starts_with(b"COWD") {
        bail!("this is a VMDK3 (COWD) sparse extent, an ESX-era format Condense does not import; convert it to a self-contained VMDK or raw on a trusted machine first");
    }
    if !head.starts_with(b"KDMV") {
        // A text descriptor: every extent it names is another file.
        let text = h.read_upto(0, 1 << 20, "VMDK descriptor")?;
        let refs = descriptor_references(&text);
        if refs.is_empty() {
            bail!("this VMDK is a descriptor file that names no extent: it holds no disk");
        }
        return Ok(refs);
    }
    if head.len() < 80 {
        bail!("the image is truncated: its VMDK header is incomplete");
    }
    let capacity = le64(&head, 12);
    let desc_offset = le64(&head, 28);
    if capacity == 0 && desc_offset != 0 {
        // qemu reads the descriptor to the first NUL within 1 MiB, whatever its stated size.
        let offset = desc_offset.saturating_mul(512);
        let text = h.read_upto(offset, 1 << 20, "embedded VMDK descriptor")?;
        let refs = descriptor_references(&text);
        if refs.is_empty() {
            bail!("this VMDK has a sparse header of capacity 0 with an embedded descriptor that names no extent: it holds no disk");
        }
        return Ok(refs);
    }
    let grain_offset = le64(&head, 64);
    h.reaches(0, grain_offset.checked_mul(512), "first grain")?;
    // qemu looks for a parent in the 10 KiB after the header, whatever the header says.
    let desc = h.read_upto(512, 10 << 10, "VMDK descriptor")?;
    Ok(parent_hint(&desc)
        .map(Reference::BackingFile)
        .into_iter()
        .collect())
}

/// The files a VMDK descriptor names: its extents and its parent.
fn descriptor_references(text: &[u8]) -> Vec<Reference> {
    let end = text.iter().position(|&b| b == 0).unwrap_or(text.len());
    let text = String::from_utf8_lossy(&text[..end]);
    let mut refs: Vec<Reference> = text
        .lines()
        .filter_map(|line| {
            // ACCESS SECTORS TYPE "FILE" [OFFSET]
            let mut words = line.split_whitespace();
            let access = words.next()?;
            if !matches!(access, "RW" | "RDONLY" | "NOACCESS") {
                return None;
            }
            let (_, quoted) = line.split_once('"')?;
            let (file, _) = quoted.split_once('"')?;
            Some(Reference::Extent(file.to_string()))
        })
        .collect();
    refs.extend(parent_hint(text.as_bytes()).map(Reference::BackingFile));
    refs
}

/// The `parentFileNameHint="NAME"` of a VMDK descriptor, found as qemu finds it.
fn parent_hint(desc: &[u8]) -> Option<String> {
    const KEY: &[u8] = b"parentFileNameHint";
    let at = desc.windows(KEY.len()).position(|w| w == KEY)?;
    // qemu skips the key, '=' and '"', and reads to the next '"'.
    let rest = desc.get(at + KEY.len() + 2..).unwrap_or(&[]);
    let end = rest.iter().position(|&b| b == b'"').unwrap_or(rest.len());
    Some(name(&rest[..end.min(1024)]))
}

/// VDI: only normal (dynamic) and fixed images; a differencing image's parent is another
/// file. The block map and the allocated blocks must lie inside the file.
fn vdi(h: &Header) -> Result<Vec<Reference>> {
    let head = h.read(0, 456.min(h.len), "VDI header")?;
    if head.len() < 456 || le32(&head, 64) != 0xbeda_107f {
        bail!("this is not a VDI image (no VDI header)");
    }
    let image_type = le32(&head, 76);
    let link = &head[424..440];
    if image_type == 4 || link.iter().any(|&b| b != 0) {
        return Ok(vec![Reference::Parent(format!(
            "(VirtualBox image UUID {})",
            uuid_le(link)
        ))]);
    }
    if image_type != 1 && image_type != 2 {
        bail!("unsupported VDI image type {image_type} (only normal and fixed images are read)");
    }
    let offset_bmap = u64::from(le32(&head, 340));
    let offset_data = u64::from(le32(&head, 344));
    let block_size = u64::from(le32(&head, 376));
    let blocks_in_image = u64::from(le32(&head, 384));
    let blocks_allocated = u64::from(le32(&head, 388));
    h.reaches(offset_bmap, blocks_in_image.checked_mul(4), "block map")?;
    h.reaches(
        offset_data,
        blocks_allocated.checked_mul(block_size),
        "allocated blocks",
    )?;
    Ok(Vec::new())
}

/// A UUID stored as VirtualBox and Microsoft store them (first three fields little-endian).
fn uuid_le(b: &[u8]) -> String {
    if b.len() < 16 {
        return "?".into();
    }
    format!(
        "{:08x}-{:04x}-{:04x}-{}-{}",
        le32(b, 0),
        le16(b, 4),
        le16(b, 6),
        hex(&b[8..10]),
        hex(&b[10..16])
    )
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

const VHDX_METADATA_REGION: [u8; 16] = [
    0x06, 0xa2, 0x7c, 0x8b, 0x90, 0x47, 0x9a, 0x4b, 0xb8, 0xfe, 0x57, 0x5f, 0x05, 0x0f, 0x88, 0x6e,
];
const VHDX_FILE_PARAMETERS: [u8; 16] = [
    0x37, 0x67, 0xa1, 0xca, 0x36, 0xfa, 0x43, 0x4d, 0xb3, 0xb6, 0x33, 0xf0, 0xaa, 0x44, 0xe7, 0x6b,
];
const VHDX_PARENT_LOCATOR: [u8; 16] = [
    0x2d, 0x5f, 0xd3, 0xa8, 0x0b, 0xb3, 0x4d, 0x45, 0xab, 0xf7, 0xd3, 0xd8, 0x48, 0x34, 0xab, 0x0c,
];

/// VHDX (MS-VHDX): a differencing image (the HasParent flag of its file parameters, or a
/// parent locator) names its parent in the locator's paths.
fn vhdx(h: &Header) -> Result<Vec<Reference>> {
    let ident = h.read(0, 8.min(h.len), "VHDX identifier")?;
    if ident != b"vhdxfile" {
        bail!("this is not a VHDX image (no vhdxfile identifier)");
    }
    // Two copies of the region table, at 192 KiB and 256 KiB.
    let mut metadata = None;
    for table_at in [192u64 << 10, 256 << 10] {
        let table = h.read(table_at, 64 << 10, "VHDX region table")?;
        if &table[..4] != b"regi" {
            continue;
        }
        let entries = (le32(&table, 8) as usize).min(2047);
        metadata = (0..entries)
            .map(|i| &table[16 + i * 32..16 + (i + 1) * 32])
            .find(|e| e[..16] == VHDX_METADATA_REGION)
            .map(|e| (le64(e, 16), u64::from(le32(e, 24))));
        break;
    }
    let Some((region_at, region_len)) = metadata else {
        bail!("corrupt VHDX image: no region table with a metadata region");
    };
    let region = h.read(region_at, region_len, "VHDX metadata region")?;
    if region.len() < 32 || &region[..8] != b"metadata" {
        bail!("corrupt VHDX image: no metadata table at offset {region_at}");
    }
    let entries = (le16(&region, 10) as usize).min(2047);
    let item = |id: &[u8; 16]| {
        (0..entries)
            .filter_map(|i| region.get(32 + i * 32..32 + (i + 1) * 32))
            .find(|e| e[..16] == id[..])
            .and_then(|e| {
                let at = le32(e, 16) as usize;
                region.get(at..at.checked_add(le32(e, 20) as usize)?)
            })
    };
    let has_parent = item(&VHDX_FILE_PARAMETERS).is_some_and(|p| le32(p, 4) & 2 != 0);
    let locator = item(&VHDX_PARENT_LOCATOR);
    if !has_parent && locator.is_none() {
        return Ok(Vec::new());
    }
    let paths = locator.map(vhdx_parent_paths).unwrap_or_default();
    Ok(vec![Reference::Parent(if paths.is_empty() {
        "(named by a parent locator Condense cannot read)".into()
    } else {
        paths.join(", ")
    })])
}

/// The paths in a VHDX parent locator (its `relative_path`, `volume_path` and
/// `absolute_win32_path` entries), as `key=path`.
fn vhdx_parent_paths(loc: &[u8]) -> Vec<String> {
    let count = le16(loc, 18) as usize;
    let text = |at: u32, len: u16| -> Option<String> {
        let s = loc.get(at as usize..(at as usize).checked_add(len as usize)?)?;
        let units: Vec<u16> = s.chunks_exact(2).map(|c| le16(c, 0)).collect();
        Some(String::from_utf16_lossy(&units))
    };
    (0..count.min(256))
        .filter_map(|i| {
            let e = loc.get(20 + i * 12..20 + (i + 1) * 12)?;
            let key = text(le32(e, 0), le16(e, 8))?;
            let value = text(le32(e, 4), le16(e, 10))?;
            key.ends_with("path").then(|| format!("{key}={value:?}"))
        })
        .collect()
}

/// VHD (vpc): a differencing disk (type 4) names its parent in its dynamic header; a dynamic
/// disk's block table must lie inside the file.
fn vpc(h: &Header) -> Result<Vec<Reference>> {
    if h.len < 512 {
        bail!("this is not a VHD image (shorter than its 512-byte footer)");
    }
    let footer = h.read(0, 512, "VHD footer")?;
    if &footer[..8] != b"conectix" {
        // A fixed disk has its footer only at the end.
        let end = h.read(h.len - 512, 512, "VHD footer")?;
        if &end[..8] == b"conectix" && be32(&end, 60) == 2 {
            return Ok(Vec::new());
        }
        bail!("this is not a VHD image (no conectix footer at its start or end)");
    }
    let disk_type = be32(&footer, 60);
    if disk_type == 2 {
        return Ok(Vec::new());
    }
    if disk_type != 3 && disk_type != 4 {
        bail!(
            "unsupported VHD disk type {disk_type} (2 fixed, 3 dynamic and 4 differencing exist)"
        );
    }
    let dynamic_at = be64(&footer, 16);
    let dynamic = h.read(dynamic_at, 1024, "VHD dynamic disk header")?;
    if &dynamic[..8] != b"cxsparse" {
        bail!("corrupt VHD image: no dynamic disk header at offset {dynamic_at}");
    }
    if disk_type == 4 {
        let units: Vec<u16> = dynamic[64..576]
            .chunks_exact(2)
            .map(|c| u16::from_be_bytes([c[0], c[1]]))
            .take_while(|&u| u != 0)
            .collect();
        return Ok(vec![Reference::Parent(format!(
            "{:?}",
            String::from_utf16_lossy(&units)
        ))]);
    }
    let entries = u64::from(be32(&dynamic, 28));
    h.reaches(be64(&dynamic, 16), entries.checked_mul(4), "block table")?;
    Ok(Vec::new())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn refs_of(bytes: &[u8], format: Format) -> Result<Vec<Reference>> {
        let mut f = tempfile::tempfile()?;
        f.write_all(bytes)?;
        let from_file = references(&f, bytes.len() as u64, format);
        let from_memory = references(&bytes, bytes.len() as u64, format);
        assert_eq!(
            from_file.as_ref().map_err(ToString::to_string),
            from_memory.as_ref().map_err(ToString::to_string),
            "the file and its bytes in memory read alike"
        );
        from_file
    }

    /// A qcow2 version 3 header of one 64 KiB cluster, with tables inside the file.
    fn qcow2_header() -> Vec<u8> {
        let mut h = vec![0u8; 3 << 16];
        h[..4].copy_from_slice(b"QFI\xfb");
        h[4..8].copy_from_slice(&3u32.to_be_bytes());
        h[20..24].copy_from_slice(&16u32.to_be_bytes());
        h[36..40].copy_from_slice(&1u32.to_be_bytes());
        h[40..48].copy_from_slice(&(2u64 << 16).to_be_bytes());
        h[48..56].copy_from_slice(&(1u64 << 16).to_be_bytes());
        h[56..60].copy_from_slice(&1u32.to_be_bytes());
        h[100..104].copy_from_slice(&112u32.to_be_bytes());
        h
    }

    #[test]
    fn qcow2_backing_and_data_files_are_named() -> Result<()> {
        let plain = qcow2_header();
        assert_eq!(refs_of(&plain, Format::Qcow2)?, vec![]);

        let mut backing = plain.clone();
        backing[8..16].copy_from_slice(&512u64.to_be_bytes());
        backing[16..20].copy_from_slice(&11u32.to_be_bytes());
        backing[512..523].copy_from_slice(b"/etc/shadow");
        assert_eq!(
            refs_of(&backing, Format::Qcow2)?,
            vec![Reference::BackingFile("/etc/shadow".into())]
        );

        let mut data = plain.clone();
        data[72..80].copy_from_slice(&4u64.to_be_bytes());
        data[112..116].copy_from_slice(&0x4441_5441u32.to_be_bytes());
        data[116..120].copy_from_slice(&8u32.to_be_bytes());
        data[120..128].copy_from_slice(b"/dev/sda");
        assert_eq!(
            refs_of(&data, Format::Qcow2)?,
            vec![Reference::DataFile("/dev/sda".into())]
        );
        Ok(())
    }

    #[test]
    fn qcow2_truncated_or_bogus_is_an_error() {
        let h = qcow2_header();
        let e = refs_of(&h[..(2 << 16) + 4], Format::Qcow2);
        assert!(e.is_err_and(|e| e.to_string().contains("L1 table")));
        let mut bad = h.clone();
        bad[20..24].copy_from_slice(&40u32.to_be_bytes());
        assert!(refs_of(&bad, Format::Qcow2).is_err());
        let mut huge = h.clone();
        huge[36..40].copy_from_slice(&u32::MAX.to_be_bytes());
        huge[40..48].copy_from_slice(&u64::MAX.to_be_bytes());
        assert!(refs_of(&huge, Format::Qcow2).is_err());
        assert!(refs_of(b"QFI\xfb", Format::Qcow2).is_err());
        assert!(refs_of(&[0u8; 4096], Format::Qcow2).is_err());
    }

    #[test]
    fn vmdk_descriptors_name_their_extents() -> Result<()> {
        let desc = b"# Disk DescriptorFile\nversion=1\nCID=fffffffe\nparentCID=ffffffff\ncreateType=\"monolithicFlat\"\n\nRW 2048 FLAT \"/tmp/host.bin\" 0\n";
        assert_eq!(
            refs_of(desc, Format::Vmdk)?,
            vec![Reference::Extent("/tmp/host.bin".into())]
        );
        let delta = b"# Disk DescriptorFile\nRW 2048 SPARSE \"a-s001.vmdk\"\nparentFileNameHint=\"/srv/base.vmdk\"\n";
        assert_eq!(
            refs_of(delta, Format::Vmdk)?,
            vec![
                Reference::Extent("a-s001.vmdk".into()),
                Reference::BackingFile("/srv/base.vmdk".into())
            ]
        );
        assert!(refs_of(b"# Disk DescriptorFile\nversion=1\n", Format::Vmdk).is_err());
        Ok(())
    }

    #[test]
    fn vmdk_sparse_header_disguising_a_descriptor_is_caught() -> Result<()> {
        let mut f = vec![0u8; 4096];
        f[..4].copy_from_slice(b"KDMV");
        f[28..36].copy_from_slice(&1u64.to_le_bytes()); // descriptor at sector 1, capacity 0
        f[36..44].copy_from_slice(&1u64.to_le_bytes());
        // The extent line lies past the stated descriptor size: qemu still reads it.
        f[512..1536].fill(b'\n');
        let d = b"RW 4 FLAT \"/etc/shadow\" 0\n";
        f[1536..1536 + d.len()].copy_from_slice(d);
        assert_eq!(
            refs_of(&f, Format::Vmdk)?,
            vec![Reference::Extent("/etc/shadow".into())]
        );
        // With a capacity, the same header is a sparse disk; a parent hint names a file.
        f[12..20].copy_from_slice(&8u64.to_le_bytes());
        f[64..72].copy_from_slice(&8u64.to_le_bytes());
        assert_eq!(refs_of(&f, Format::Vmdk)?, vec![]);
        f[512..2048].fill(0);
        let p = b"parentFileNameHint=\"/etc/shadow\"";
        f[1024..1024 + p.len()].copy_from_slice(p);
        assert_eq!(
            refs_of(&f, Format::Vmdk)?,
            vec![Reference::BackingFile("/etc/shadow".into())]
        );
        // Grains past the end of the file: truncated.
        f[64..72].copy_from_slice(&100u64.to_le_bytes());
        assert!(refs_of(&f, Format::Vmdk).is_err());
        assert!(refs_of(b"COWD", Format::Vmdk).is_err());
        Ok(())
    }

    #[test]
    fn vdi_differencing_and_truncated() -> Result<()> {
        let mut f = vec![0u8; 2048];
        f[64..68].copy_from_slice(&0xbeda_107fu32.to_le_bytes());
        f[76..80].copy_from_slice(&1u32.to_le_bytes());
        f[340..344].copy_from_slice(&512u32.to_le_bytes());
        f[344..348].copy_from_slice(&1024u32.to_le_bytes());
        f[376..380].copy_from_slice(&1024u32.to_le_bytes());
        f[384..388].copy_from_slice(&2u32.to_le_bytes());
        f[388..392].copy_from_slice(&1u32.to_le_bytes());
        assert_eq!(refs_of(&f, Format::Vdi)?, vec![]);
        let mut diff = f.clone();
        diff[76..80].copy_from_slice(&4u32.to_le_bytes());
        diff[424] = 0xab;
        assert!(matches!(
            refs_of(&diff, Format::Vdi)?[..],
            [Reference::Parent(_)]
        ));
        assert!(refs_of(&f[..1500], Format::Vdi).is_err());
        Ok(())
    }

    #[test]
    fn vpc_differencing_names_its_parent() -> Result<()> {
        let mut f = vec![0u8; 4096];
        f[..8].copy_from_slice(b"conectix");
        f[16..24].copy_from_slice(&512u64.to_be_bytes());
        f[60..64].copy_from_slice(&4u32.to_be_bytes());
        f[512..520].copy_from_slice(b"cxsparse");
        for (i, c) in "base.vhd".encode_utf16().enumerate() {
            f[512 + 64 + 2 * i..512 + 66 + 2 * i].copy_from_slice(&c.to_be_bytes());
        }
        assert_eq!(
            refs_of(&f, Format::Vpc)?,
            vec![Reference::Parent("\"base.vhd\"".into())]
        );
        f[60..64].copy_from_slice(&3u32.to_be_bytes());
        f[512 + 16..512 + 24].copy_from_slice(&1536u64.to_be_bytes());
        f[512 + 28..512 + 32].copy_from_slice(&4u32.to_be_bytes());
        assert_eq!(refs_of(&f, Format::Vpc)?, vec![]);
        f[512 + 28..512 + 32].copy_from_slice(&4096u32.to_be_bytes());
        assert!(refs_of(&f, Format::Vpc).is_err());
        Ok(())
    }

    #[test]
    fn garbage_never_panics() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        for len in [0usize, 1, 7, 64, 511, 512, 4096, 70_000, 300_000] {
            for magic in [&b"QFI\xfb"[..], b"KDMV", b"vhdxfile", b"conectix", b""] {
                let mut f: Vec<u8> = (0..len)
                    .map(|_| {
                        seed ^= seed << 13;
                        seed ^= seed >> 7;
                        seed ^= seed << 17;
                        seed as u8
                    })
                    .collect();
                let n = magic.len().min(f.len());
                f[..n].copy_from_slice(&magic[..n]);
                for format in Format::ALL {
                    let _ = refs_of(&f, format);
                }
            }
        }
    }
}

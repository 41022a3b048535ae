//! Disk images as the guest sees them: which ranges hold data, and their bytes.
//!
//! Every image is first checked by [`crate::image::open`] (it reads no file but itself, and is
//! consistent), and from then on read only through the file it opened, never by name again.
//! Raw images are read directly from that file; their holes are found with SEEK_DATA/SEEK_HOLE
//! and never read. Every other format (qcow2, vmdk, vdi, vhdx, vpc) goes through the qemu
//! tools, which inherit the file's descriptor ([`CheckedImage::share_with`]) and are given the
//! image as [`CheckedImage::qemu_args`]: `qemu-img map` says which guest
//! ranges read as zeros (skipped without reading), and the data comes from `qemu-nbd -r` on a
//! private Unix socket through [`NbdClient`]. Condense reads no image data format itself.

use super::nbd_client::NbdClient;
use crate::error::{bail, Context, Result};
use crate::image::{qemu_nbd, CheckedImage, ImageOptions};
use crate::probe::Format;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One image to estimate, with its data ranges found but nothing read yet.
pub struct Image {
    pub path: PathBuf,
    pub name: String,
    /// The checked image file; its format is raw or one read through qemu.
    pub checked: CheckedImage,
    /// Size of the guest disk.
    pub logical_bytes: u64,
    /// Bytes the image file takes on the host (st_blocks × 512).
    pub file_bytes: u64,
    /// Guest ranges to read: (offset, length), sorted, merged, aligned to the chunk size.
    pub extents: Vec<(u64, u64)>,
}

impl Image {
    pub fn data_bytes(&self) -> u64 {
        self.extents.iter().map(|e| e.1).sum()
    }
}

/// Sort, align outwards to `align` (clipped to the aligned disk end) and merge ranges.
pub(crate) fn align_merge(mut ranges: Vec<(u64, u64)>, align: u64, size: u64) -> Vec<(u64, u64)> {
    ranges.sort_unstable();
    // `size` and the ranges come from the image's header (through qemu-img): an end past the
    // last aligned offset below 2^64 is clipped to it.
    let up = |x: u64| {
        x.div_ceil(align)
            .checked_mul(align)
            .unwrap_or(u64::MAX / align * align)
    };
    let end_limit = up(size);
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (start, len) in ranges {
        if len == 0 {
            continue;
        }
        let s = start / align * align;
        let e = up(start.saturating_add(len)).min(end_limit);
        if s >= e {
            continue;
        }
        match out.last_mut() {
            Some(last) if s <= last.0 + last.1 => {
                let end = (last.0 + last.1).max(e);
                last.1 = end - last.0;
            }
            _ => out.push((s, e - s)),
        }
    }
    out
}

/// Data ranges of a raw file via SEEK_DATA/SEEK_HOLE (everything, where unsupported).
fn raw_extents(f: &File, size: u64, path: &Path) -> Result<Vec<(u64, u64)>> {
    let fd = f.as_raw_fd();
    let mut out = Vec::new();
    let mut pos: u64 = 0;
    while pos < size {
        // SAFETY: lseek on a descriptor owned by `f` for the duration of the call.
        let data = unsafe { libc::lseek(fd, pos as libc::off_t, libc::SEEK_DATA) };
        if data < 0 {
            let err = std::io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::ENXIO) => break, // no data past pos
                Some(libc::EINVAL) if pos == 0 => return Ok(vec![(0, size)]),
                _ => {
                    return Err(err)
                        .with_context(|| format!("cannot find the data in {}", path.display()))
                }
            }
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        let end = if hole < 0 {
            size
        } else {
            (hole as u64).min(size)
        };
        let data = data as u64;
        if end <= data {
            break;
        }
        out.push((data, end - data));
        pos = end;
    }
    Ok(out)
}

/// `qemu-img map --output=json`: the guest ranges that do not read as zeros.
pub fn parse_map(json: &[u8]) -> Result<Vec<(u64, u64)>> {
    let v: serde_json::Value =
        serde_json::from_slice(json).context("qemu-img map printed invalid JSON")?;
    let list = v.as_array().context("qemu-img map did not print a list")?;
    let mut out = Vec::new();
    for e in list {
        let start = e.get("start").and_then(serde_json::Value::as_u64);
        let length = e.get("length").and_then(serde_json::Value::as_u64);
        let (Some(start), Some(length)) = (start, length) else {
            bail!("qemu-img map printed an extent without start/length: {e}");
        };
        let zero = e
            .get("zero")
            .and_then(serde_json::Value::as_bool)
            .unwrap_or(false);
        if !zero {
            out.push((start, length));
        }
    }
    Ok(out)
}

/// Check the image at `path` ([`crate::image::open`]) and find what to read in it, extents
/// aligned to `align` bytes.
pub fn open(path: &Path, align: u64, opts: &ImageOptions) -> Result<Image> {
    let name = path
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("image")
        .to_string();
    let checked = crate::image::open(path, opts)?;
    let meta = checked
        .file()
        .metadata()
        .with_context(|| format!("cannot examine image {}", path.display()))?;
    let file_bytes = meta.blocks() * 512;
    let size = checked.virtual_size;
    let ranges = if checked.format != Format::Raw {
        parse_map(&checked.run_qemu_img(
            &["map", "--output=json"],
            &format!("map {}", path.display()),
        )?)?
    } else if checked.block_device {
        // A device has no holes to find: all of it is read.
        vec![(0, size)]
    } else {
        raw_extents(checked.file(), size, path)?
    };
    Ok(Image {
        path: path.to_path_buf(),
        name,
        extents: align_merge(ranges, align, size),
        checked,
        logical_bytes: size,
        file_bytes,
    })
}

/// Reads guest bytes of one image.
pub enum Reader {
    /// The checked file itself.
    Raw {
        file: Arc<File>,
        size: u64,
    },
    Nbd(NbdSource),
}

pub struct NbdSource {
    client: Option<NbdClient>,
    child: Child,
    dir: PathBuf,
    size: u64,
}

impl Reader {
    pub fn open(image: &Image) -> Result<Reader> {
        if image.checked.format == Format::Raw {
            return Ok(Reader::Raw {
                file: image.checked.file().clone(),
                size: image.logical_bytes,
            });
        }
        Ok(Reader::Nbd(NbdSource::start(image)?))
    }

    /// Fill `buf` with guest bytes from `offset`; bytes past the disk's end read as zeros.
    pub fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let size = match self {
            Reader::Raw { size, .. } => *size,
            Reader::Nbd(s) => s.size,
        };
        let n = size.saturating_sub(offset).min(buf.len() as u64) as usize;
        let (data, tail) = buf.split_at_mut(n);
        tail.fill(0);
        match self {
            Reader::Raw { file, .. } => file
                .read_exact_at(data, offset)
                .with_context(|| format!("reading {n} bytes at offset {offset}")),
            Reader::Nbd(s) => s
                .client
                .as_mut()
                .context("the NBD connection is closed")?
                .read_at(offset, data),
        }
    }
}

impl NbdSource {
    fn start(image: &Image) -> Result<NbdSource> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let dir = std::env::temp_dir().join(format!(
            "condense-estimate-{}-{nanos:x}",
            std::process::id()
        ));
        std::fs::create_dir(&dir)
            .with_context(|| format!("cannot create a socket directory {}", dir.display()))?;
        let socket = dir.join("nbd.sock");
        let log_path = dir.join("qemu-nbd.log");
        let spawned = File::create(&log_path)
            .with_context(|| format!("cannot create {}", log_path.display()))
            .and_then(|log| {
                let mut cmd = qemu_nbd();
                image
                    .checked
                    .share_with(&mut cmd)
                    .arg("-r")
                    .arg("--socket")
                    .arg(&socket)
                    .args(image.checked.qemu_args())
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::from(log))
                    .spawn()
                    .context("cannot run qemu-nbd (install qemu-utils)")
            });
        let child = match spawned {
            Ok(c) => c,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e);
            }
        };
        let mut src = NbdSource {
            client: None,
            child,
            dir,
            size: image.logical_bytes,
        };
        let started = Instant::now();
        loop {
            if socket.exists() {
                if let Ok(c) = NbdClient::connect(&socket) {
                    if c.size() < image.logical_bytes {
                        bail!(
                            "qemu-nbd exports {} bytes of {}, but qemu-img said {}",
                            c.size(),
                            image.path.display(),
                            image.logical_bytes
                        );
                    }
                    src.client = Some(c);
                    return Ok(src);
                }
            }
            if let Ok(Some(status)) = src.child.try_wait() {
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                bail!(
                    "qemu-nbd could not serve {} ({status}): {}",
                    image.path.display(),
                    log.trim()
                );
            }
            if started.elapsed() > Duration::from_secs(30) {
                bail!(
                    "qemu-nbd did not start serving {} within 30 s",
                    image.path.display()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for NbdSource {
    fn drop(&mut self) {
        // Disconnecting makes qemu-nbd (not --persistent) exit; stop it if it does not.
        self.client = None;
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match self.child.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) if Instant::now() > deadline => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    break;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn align_and_merge() {
        let r = align_merge(
            vec![(5000, 10), (0, 100), (8192, 1), (20000, 0)],
            4096,
            10000,
        );
        assert_eq!(r, vec![(0, 12288)]);
        let r = align_merge(vec![(0, 4096), (16384, 4096)], 4096, 1 << 20);
        assert_eq!(r, vec![(0, 4096), (16384, 4096)]);
    }

    #[test]
    fn map_skips_zero_extents() -> Result<()> {
        let json = br#"[{"start": 0, "length": 65536, "depth": 0, "present": true, "zero": false, "data": true, "offset": 327680},
{"start": 65536, "length": 1048576, "depth": 0, "present": false, "zero": true, "data": false}]"#;
        assert_eq!(parse_map(json)?, vec![(0, 65536)]);
        assert!(parse_map(b"{}").is_err());
        Ok(())
    }

    /// Found writing the qemu_img_json fuzz target: a virtual size or extent near 2^64 (qemu-img
    /// prints what the image's header says) overflowed aligning the disk's end (a panic in
    /// debug builds; in release every range was clipped away). Ends are now clipped to the
    /// last aligned offset and stay aligned.
    #[test]
    fn sizes_near_two_to_the_64_stay_aligned() {
        let top = u64::MAX / 4096 * 4096;
        let r = align_merge(
            vec![(u64::MAX - 10, 100), (0, 1), (top - 100, 50)],
            4096,
            u64::MAX,
        );
        assert_eq!(r, vec![(0, 4096), (top - 4096, 4096)]);
        let r = align_merge(vec![(0, u64::MAX)], 4096, u64::MAX - 1);
        assert_eq!(r, vec![(0, top)]);
    }
}

//! A disk image from outside, opened for reading as untrusted input: `condense import` and
//! `condense estimate` read exactly the file named, nothing else.
//!
//! An image file can name other files: a qcow2 backing file or external data file, the
//! extents of a VMDK descriptor, the parent of a differencing VMDK, VDI, VHDX or VHD. A qemu
//! tool that opens such an image reads those files too, so an image made by someone else (or
//! a header a guest wrote into the first sector of its raw disk) could pull any host file into
//! a volume. [`open`] therefore, in this order:
//!
//! 1. refuses file names that qemu would read as a protocol (`nbd:`, `http:`, `json:`...);
//!    opens the file once, without following a symbolic link (`O_NOFOLLOW`), and refuses
//!    anything but a regular file or a block device (a FIFO, a socket, a terminal);
//! 2. decides the format: `--format` if given, else the magic of the first bytes
//!    ([`crate::probe`]); a file with no known magic is raw and is read directly, never by qemu;
//! 3. reads the header itself ([`crate::inspect`]) and refuses an image that names another
//!    file, or whose tables lie past the end of the file, before any qemu tool opens it;
//! 4. asks `qemu-img info` and refuses if qemu sees a reference the header check missed;
//! 5. runs `qemu-img check` where the format has one, and refuses an inconsistent image.
//!
//! Invariant: **what was checked is what is read.** The name is opened once; every later step
//! reads that open file, never the name again, so a file swapped in under the name after the
//! checks (a `rename` in a directory the image's owner writes) is never read. Condense reads
//! the [`CheckedImage::file`] itself (headers, raw data), and every qemu tool inherits the
//! descriptor ([`CheckedImage::share_with`]) and is given the image as
//! [`CheckedImage::qemu_args`]: the format pinned to what the checks found (`-f` and the
//! driver), the inherited descriptor as `/proc/self/fd/N` through the `file` (or `host_device`)
//! driver, and `"backing": null`, so that not even an image rewritten in place after the
//! checks opens a backing file. An image whose size or modification time moved while it was
//! read ([`CheckedImage::is_unchanged`]) is refused afterwards.
//!
//! What remains: the owner of an image who rewrites it in place while it is read, and sets its
//! modification time back. qemu 10 has no option that stops a qcow2 from opening the external
//! data file its header names (a `data-file` option is refused for images without one, so it
//! cannot be forced off) or a VMDK descriptor from opening its extents; such a rewrite between
//! the checks and qemu's open would be read with them. Import images from where their
//! uploader can no longer write (docs/SECURITY.md).
//!
//! `--allow-backing-file` skips the refusals of steps 3 and 4 and the two overrides, and
//! names the file by its path (qemu resolves relative backing file names against it), for
//! administrators who trust the image and the files it names.

use crate::error::{bail, Context, Result};
use crate::inspect;
use crate::probe::{self, Format, Probed};
use std::ffi::OsString;
use std::fs::File;
use std::io::{Seek, SeekFrom};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;

/// How to treat an image file: what the administrator told us about it.
#[derive(Debug, Clone, Default)]
pub struct ImageOptions {
    /// The format, if known (`--format`); `None`: probe the first bytes.
    pub format: Option<Format>,
    /// Let the image read the other files it names (`--allow-backing-file`).
    pub allow_backing_file: bool,
}

/// An image file that passed [`open`]'s checks, still open: everything that reads the image
/// reads [`CheckedImage::file`], never [`CheckedImage::path`] again.
#[derive(Debug, Clone)]
pub struct CheckedImage {
    /// The name it was opened by, for messages.
    pub path: PathBuf,
    file: Arc<File>,
    /// The file as it was when opened, to tell whether it changed while it was read.
    stamp: Stamp,
    pub format: Format,
    /// The path is a block device (read through qemu's `host_device` driver).
    pub block_device: bool,
    /// The guest disk's size: the file's for raw, the header's for other formats.
    pub virtual_size: u64,
    allow_references: bool,
}

/// The qemu-img command (`$CONDENSE_QEMU_IMG` overrides the program).
pub fn qemu_img() -> Command {
    Command::new(std::env::var_os("CONDENSE_QEMU_IMG").unwrap_or_else(|| "qemu-img".into()))
}

/// The qemu-nbd command (`$CONDENSE_QEMU_NBD` overrides the program).
pub fn qemu_nbd() -> Command {
    Command::new(std::env::var_os("CONDENSE_QEMU_NBD").unwrap_or_else(|| "qemu-nbd".into()))
}

/// What tells that a file's content changed while it was read: a write or a truncation moves
/// its size or its modification time. Not its change time: that also moves when the name is
/// renamed over or removed, which does not change what the open file holds. (Its owner can
/// set the modification time back after a write: this catches an image still being written,
/// not an owner who hides a rewrite; qemu's options, not this, keep such a rewrite from
/// opening other files, see the module documentation.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    size: u64,
    mtime: (i64, i64),
}

impl Stamp {
    fn of(meta: &std::fs::Metadata) -> Stamp {
        Stamp {
            size: meta.size(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
        }
    }
}

/// True if qemu would read `name` as a protocol or a `json:` description rather than a file
/// (qemu's rule: a ':' before the first '/').
pub fn looks_like_protocol(name: &str) -> bool {
    let upto = name.find('/').unwrap_or(name.len());
    name[..upto].contains(':')
}

/// Check the image at `path` as the module documentation says; refuse it with an error that
/// names the file it refers to, or what is wrong with it.
pub fn open(path: &Path, opts: &ImageOptions) -> Result<CheckedImage> {
    let shown = path.display();
    if looks_like_protocol(&path.to_string_lossy()) {
        bail!(
            "{shown} looks like a qemu protocol or json: name, not a file; Condense reads only local image files (if it is a file, name it as ./{shown})"
        );
    }
    let mut file = open_once(path)?;
    let meta = file
        .metadata()
        .with_context(|| format!("cannot examine image {shown}"))?;
    let block_device = meta.file_type().is_block_device();
    let len = if block_device {
        file.seek(SeekFrom::End(0))
            .with_context(|| format!("cannot read the size of {shown}"))?
    } else {
        meta.len()
    };
    let mut head = [0u8; probe::PROBE_BYTES];
    let n = read_head(&file, &mut head).with_context(|| format!("cannot read {shown}"))?;
    let probed = probe::probe(&head[..n]);
    let format = match (opts.format, probed) {
        (Some(f), _) => f,
        (None, Probed::Raw) => Format::Raw,
        (None, Probed::Image(f)) => f,
        (None, Probed::Unsupported(what)) => bail!(
            "{shown} starts like a {what} image, a format Condense does not read; convert it with qemu-img on a machine you trust, or, if it is a raw disk whose first bytes only look like that (a guest can write them), pass --format raw"
        ),
    };
    let mut image = CheckedImage {
        path: path.to_path_buf(),
        file: Arc::new(file),
        stamp: Stamp::of(&meta),
        format,
        block_device,
        virtual_size: len,
        allow_references: opts.allow_backing_file,
    };
    if format == Format::Raw {
        return Ok(image);
    }
    // From here on, `shown` says how the format was chosen.
    let probed_hint = if opts.format.is_none() {
        format!(
            "; the format was probed from its first bytes: if it is a raw disk whose first sector only looks like a {format} header (a guest can write one), pass --format raw"
        )
    } else {
        String::new()
    };
    if opts.allow_backing_file && path.to_str().is_none() {
        bail!("{shown}: with --allow-backing-file, a {format} image needs a file name that is valid UTF-8 (qemu takes it in JSON); rename it");
    }
    let refs = inspect::references(&*image.file, len, format).map_err(|e| {
        crate::Error::Invalid(format!("refusing {shown} ({format}): {e}{probed_hint}"))
    })?;
    if !refs.is_empty() && !opts.allow_backing_file {
        let names: Vec<String> = refs.iter().map(ToString::to_string).collect();
        refuse_references(path, format, &names, &probed_hint)?;
    }
    let info = image.info()?;
    if info.format != format.name() {
        bail!(
            "qemu-img reads {shown} as {}, not {format}; refusing it",
            info.format
        );
    }
    if !info.references.is_empty() && !opts.allow_backing_file {
        refuse_references(path, format, &info.references, &probed_hint)?;
    }
    if info.virtual_size == 0 {
        bail!("image {shown} has a virtual size of 0");
    }
    image.virtual_size = info.virtual_size;
    if format.has_check() {
        image.check()?;
    }
    Ok(image)
}

/// Open `path` for reading, once: not through a symbolic link (`O_NOFOLLOW`), never as a
/// controlling terminal, and only if it is a regular file or a block device (a FIFO would
/// block and could be fed anything; the open itself does not block: `O_NONBLOCK`, cleared
/// afterwards). The descriptor is 3 or more, so that a child's standard streams never replace
/// it, and closed on exec unless [`CheckedImage::share_with`] passes it on.
fn open_once(path: &Path) -> Result<File> {
    let shown = path.display();
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NOCTTY | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => crate::Error::Invalid(format!(
                "refusing {shown}: it is a symbolic link{}; Condense opens only the image file itself, so that what it checks is what it reads: name the file",
                std::fs::read_link(path)
                    .map(|t| format!(" (to {})", t.display()))
                    .unwrap_or_default()
            )),
            _ => crate::Error::Failed {
                what: format!("cannot open image {shown}"),
                source: Box::new(e),
            },
        })?;
    let kind = file
        .metadata()
        .with_context(|| format!("cannot examine image {shown}"))?
        .file_type();
    let what = if kind.is_fifo() {
        Some("a FIFO (named pipe)")
    } else if kind.is_socket() {
        Some("a socket")
    } else if kind.is_char_device() {
        Some("a character device")
    } else if !kind.is_file() && !kind.is_block_device() {
        Some("neither a file nor a block device")
    } else {
        None
    };
    if let Some(what) = what {
        bail!(
            "refusing {shown}: it is {what}, not a disk image file or a block device; to import a stream, pipe it into `condense import - --name NAME --size SIZE`"
        );
    }
    let fd = file.as_raw_fd();
    // SAFETY: fcntl on a descriptor `file` owns; F_DUPFD_CLOEXEC returns a new descriptor
    // that the OwnedFd then owns.
    let file = if fd < 3 {
        let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3) };
        if dup < 0 {
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("cannot duplicate the descriptor of {shown}"));
        }
        File::from(unsafe { OwnedFd::from_raw_fd(dup) })
    } else {
        file
    };
    let fd = file.as_raw_fd();
    // SAFETY: as above; clears O_NONBLOCK, keeping the other status flags.
    let cleared = unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) == 0
    };
    if !cleared {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("cannot set up the descriptor of {shown}"));
    }
    Ok(file)
}

/// Read the first bytes of `file` (fewer if it is shorter).
fn read_head(file: &File, head: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < head.len() {
        match file.read_at(&mut head[n..], n as u64) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

fn refuse_references(path: &Path, format: Format, names: &[String], hint: &str) -> Result<()> {
    bail!(
        "refusing {}: this {format} image refers to {}, and reading it would read that too (Condense reads only the file named). If you trust this image and mean to read what it refers to, pass --allow-backing-file (never for images from guests or other untrusted sources){hint}",
        path.display(),
        names.join(" and ")
    )
}

impl CheckedImage {
    /// The open image file, the one that was checked.
    pub fn file(&self) -> &Arc<File> {
        &self.file
    }

    /// True if the file still has the size and modification time it had when it was opened
    /// (nobody wrote or truncated it meanwhile, see [`Stamp`]); false if they moved or it
    /// cannot be examined.
    pub fn is_unchanged(&self) -> bool {
        self.file
            .metadata()
            .is_ok_and(|m| Stamp::of(&m) == self.stamp)
    }

    /// The image as a qemu tool's arguments: `-f FORMAT json:{...}`, naming the driver, the
    /// checked file's descriptor (never a name, never a protocol) and, unless references are
    /// allowed, no backing file. The tool must inherit the descriptor:
    /// [`Self::share_with`].
    pub fn qemu_args(&self) -> Vec<OsString> {
        vec![
            "-f".into(),
            self.format.name().into(),
            self.qemu_spec().into(),
        ]
    }

    /// The name a qemu tool that [`Self::share_with`] ran opens the image by.
    fn qemu_filename(&self) -> String {
        if self.allow_references {
            // Trusted: relative backing file names resolve against the image's own path.
            self.path.to_string_lossy().into_owned()
        } else {
            format!("/proc/self/fd/{}", self.file.as_raw_fd())
        }
    }

    fn qemu_spec(&self) -> String {
        let file_driver = if self.block_device {
            "host_device"
        } else {
            "file"
        };
        let mut spec = serde_json::json!({
            "driver": self.format.name(),
            "file": {
                "driver": file_driver,
                "filename": self.qemu_filename(),
            },
        });
        if !self.allow_references {
            spec["backing"] = serde_json::Value::Null;
        }
        format!("json:{spec}")
    }

    /// Let `cmd` (a qemu tool) inherit the image's descriptor, which [`Self::qemu_args`]
    /// names. It stays closed on exec for every other child.
    pub fn share_with<'a>(&self, cmd: &'a mut Command) -> &'a mut Command {
        let file = self.file.clone();
        // SAFETY: the hook runs in the child between fork and exec and calls only fcntl, which
        // is async-signal-safe; it allocates nothing. `file` keeps the descriptor open for as
        // long as `cmd` exists, and the descriptor is 3 or more (`open_once`), so the child's
        // standard streams do not replace it.
        unsafe {
            cmd.pre_exec(move || {
                if libc::fcntl(file.as_raw_fd(), libc::F_SETFD, 0) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            })
        }
    }

    /// `qemu-img SUBCOMMAND... IMAGE`, the image given as [`Self::qemu_args`].
    fn qemu_img_output(&self, subcommand: &[&str]) -> Result<Output> {
        let mut cmd = qemu_img();
        cmd.args(subcommand).args(self.qemu_args());
        self.share_with(&mut cmd)
            .stdin(Stdio::null())
            .output()
            .context("cannot run qemu-img (install qemu-utils)")
    }

    /// Run `qemu-img SUBCOMMAND... IMAGE`; its standard output, or an error saying it could
    /// not `what`.
    pub(crate) fn run_qemu_img(&self, subcommand: &[&str], what: &str) -> Result<Vec<u8>> {
        let out = self.qemu_img_output(subcommand)?;
        if !out.status.success() {
            bail!(
                "qemu-img cannot {what}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(out.stdout)
    }

    fn info(&self) -> Result<probe::ImageInfo> {
        let out = self.run_qemu_img(
            &["info", "--output=json"],
            &format!("read {}", self.path.display()),
        )?;
        probe::parse_image_info(&out, &self.qemu_filename())
            .with_context(|| format!("cannot read the format of {}", self.path.display()))
    }

    /// `qemu-img check`: refuse an image with corruptions (leaked clusters are harmless).
    fn check(&self) -> Result<()> {
        let out = self.qemu_img_output(&["check"])?;
        match out.status.code() {
            // 0: clean; 3: only leaked clusters; 63: the format cannot be checked.
            Some(0 | 3 | 63) => Ok(()),
            Some(2) => {
                let text = format!(
                    "{}\n{}",
                    String::from_utf8_lossy(&out.stderr),
                    String::from_utf8_lossy(&out.stdout)
                );
                let summary = text
                    .lines()
                    .find(|l| l.contains("were found"))
                    .unwrap_or("errors were found")
                    .trim()
                    .trim_end_matches('.');
                let details: Vec<&str> = text
                    .lines()
                    .map(str::trim)
                    .filter(|l| l.starts_with("ERROR") || l.starts_with("qemu-img:"))
                    .collect();
                bail!(
                    "refusing {}: qemu-img check finds the {} image truncated or inconsistent ({summary}), so some of its data would read as zeros or garbage: {}{}",
                    self.path.display(),
                    self.format,
                    details.iter().take(3).copied().collect::<Vec<_>>().join("; "),
                    if details.len() > 3 {
                        format!("; and {} more", details.len() - 3)
                    } else {
                        String::new()
                    }
                )
            }
            _ => bail!(
                "refusing {}: qemu-img check cannot check this {} image ({}): {}",
                self.path.display(),
                self.format,
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protocol_names() {
        for p in [
            "nbd:localhost:10809",
            "json:{}",
            "http://example.com/a.qcow2",
            "a:b/c",
        ] {
            assert!(looks_like_protocol(p), "{p}");
        }
        for p in ["disk.qcow2", "./nbd:x", "/srv/a:b.qcow2", "dir/a:b"] {
            assert!(!looks_like_protocol(p), "{p}");
        }
    }

    #[test]
    fn qemu_args_name_the_descriptor_and_no_backing() -> Result<()> {
        let file = tempfile::tempfile()?;
        let meta = file.metadata()?;
        let fd = file.as_raw_fd();
        let mut image = CheckedImage {
            path: "/srv/a \"b\",c.qcow2".into(),
            file: Arc::new(file),
            stamp: Stamp::of(&meta),
            format: Format::Qcow2,
            block_device: false,
            virtual_size: 1,
            allow_references: false,
        };
        let spec = image.qemu_spec();
        let json: serde_json::Value =
            serde_json::from_str(spec.trim_start_matches("json:")).unwrap_or_default();
        assert_eq!(json["driver"], "qcow2");
        assert_eq!(json["file"]["driver"], "file");
        assert_eq!(json["file"]["filename"], format!("/proc/self/fd/{fd}"));
        assert!(json["backing"].is_null() && json.get("backing").is_some());
        assert!(json.get("data-file").is_none());
        assert!(image.is_unchanged());
        image.file.set_len(4096)?;
        assert!(!image.is_unchanged(), "a write is seen");
        image.allow_references = true;
        image.block_device = true;
        let spec = image.qemu_spec();
        assert!(!spec.contains("backing"));
        assert!(spec.contains("host_device") && spec.contains("/srv/a"));
        Ok(())
    }

    #[test]
    fn links_and_fifos_are_refused_by_name() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let real = dir.path().join("real.raw");
        std::fs::write(&real, [1u8; 4096])?;
        let link = dir.path().join("link.raw");
        std::os::unix::fs::symlink(&real, &link)?;
        let opts = ImageOptions::default();
        let e = open(&link, &opts).err().map(|e| e.to_string());
        assert!(
            e.as_deref().is_some_and(|e| e.contains("symbolic link")),
            "{e:?}"
        );
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes())
            .map_err(|e| crate::Error::Invalid(e.to_string()))?;
        // SAFETY: mkfifo with a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = open(&fifo, &opts).err().map(|e| e.to_string());
        assert!(e.as_deref().is_some_and(|e| e.contains("FIFO")), "{e:?}");
        let checked = open(&real, &opts)?;
        assert_eq!((checked.format, checked.virtual_size), (Format::Raw, 4096));
        assert!(checked.file().as_raw_fd() >= 3);
        Ok(())
    }
}

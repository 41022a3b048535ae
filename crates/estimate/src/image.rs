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
//! 2. decides the format: `--format` if given, else the magic of the first bytes
//!    ([`crate::probe`]); a file with no known magic is raw and is read directly, never by qemu;
//! 3. reads the header itself ([`crate::inspect`]) and refuses an image that names another
//!    file, or whose tables lie past the end of the file, before any qemu tool opens it;
//! 4. asks `qemu-img info` and refuses if qemu sees a reference the header check missed;
//! 5. runs `qemu-img check` where the format has one, and refuses an inconsistent image.
//!
//! Every qemu tool is then given the image as [`CheckedImage::qemu_args`]: the format
//! explicitly (`-f`), the local file through the `file` (or `host_device`) driver so that no
//! protocol is parsed from its name, and `"backing": null` so that no backing file is opened
//! even if the file changed after the check. `--allow-backing-file` skips the refusals of
//! steps 3 and 4 and the `"backing": null`, for administrators who trust the image.

use crate::error::{bail, Context, Result};
use crate::inspect;
use crate::probe::{self, Format, Probed};
use std::ffi::OsString;
use std::fs::File;
use std::io::{Seek, SeekFrom};
use std::os::unix::fs::{FileExt, FileTypeExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// How to treat an image file: what the administrator told us about it.
#[derive(Debug, Clone, Default)]
pub struct ImageOptions {
    /// The format, if known (`--format`); `None`: probe the first bytes.
    pub format: Option<Format>,
    /// Let the image read the other files it names (`--allow-backing-file`).
    pub allow_backing_file: bool,
}

/// An image file that passed [`open`]'s checks.
#[derive(Debug, Clone)]
pub struct CheckedImage {
    pub path: PathBuf,
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

/// Run qemu-img with `args`; its standard output, or an error saying it could not `what`.
pub(crate) fn run_qemu_img(args: &[OsString], what: &str) -> Result<Vec<u8>> {
    let out = qemu_img_output(args)?;
    if !out.status.success() {
        bail!(
            "qemu-img cannot {what}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(out.stdout)
}

fn qemu_img_output(args: &[OsString]) -> Result<Output> {
    qemu_img()
        .args(args)
        .stdin(Stdio::null())
        .output()
        .context("cannot run qemu-img (install qemu-utils)")
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
    let meta = std::fs::metadata(path).with_context(|| format!("cannot open image {shown}"))?;
    let block_device = meta.file_type().is_block_device();
    if !meta.is_file() && !block_device {
        bail!("{shown} is neither a disk image file nor a block device");
    }
    let mut file = File::open(path).with_context(|| format!("cannot open image {shown}"))?;
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
    if path.to_str().is_none() {
        bail!("{shown}: a {format} image needs a file name that is valid UTF-8 (qemu takes it in JSON); rename it");
    }
    let refs = inspect::references(&file, len, format).map_err(|e| {
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
    /// The image as a qemu tool's arguments: `-f FORMAT json:{...}`, naming the driver, the
    /// local file (never a protocol) and, unless references are allowed, no backing file.
    pub fn qemu_args(&self) -> Vec<OsString> {
        vec![
            "-f".into(),
            self.format.name().into(),
            self.qemu_spec().into(),
        ]
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
                "filename": self.path.to_string_lossy(),
            },
        });
        if !self.allow_references {
            spec["backing"] = serde_json::Value::Null;
        }
        format!("json:{spec}")
    }

    fn info(&self) -> Result<probe::ImageInfo> {
        let mut args: Vec<OsString> = vec!["info".into(), "--output=json".into()];
        args.extend(self.qemu_args());
        let out = run_qemu_img(&args, &format!("read {}", self.path.display()))?;
        probe::parse_image_info(&out, &self.path.to_string_lossy())
            .with_context(|| format!("cannot read the format of {}", self.path.display()))
    }

    /// `qemu-img check`: refuse an image with corruptions (leaked clusters are harmless).
    fn check(&self) -> Result<()> {
        let mut args: Vec<OsString> = vec!["check".into()];
        args.extend(self.qemu_args());
        let out = qemu_img_output(&args)?;
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
    fn qemu_args_name_the_file_driver_and_no_backing() {
        let mut image = CheckedImage {
            path: "/srv/a \"b\",c.qcow2".into(),
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
        assert_eq!(json["file"]["filename"], "/srv/a \"b\",c.qcow2");
        assert!(json["backing"].is_null() && json.get("backing").is_some());
        image.allow_references = true;
        image.block_device = true;
        assert!(!image.qemu_spec().contains("backing"));
        assert!(image.qemu_spec().contains("host_device"));
    }
}

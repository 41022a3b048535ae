//! Import and export of the image formats qemu-img knows (qcow2, vmdk, vdi, vhdx, vpc), through
//! `qemu-img convert` to or from an in-process NBD export on a private Unix socket. Holes stay
//! holes both ways because qemu-img skips zero ranges and reads our block status.
//!
//! An imported image has been checked by `condense_estimate::image::open` (it reads no file
//! but itself, and is consistent), and qemu-img gets it only as `CheckedImage::qemu_args`:
//! the format explicit, the local file driver, no backing file.

use crate::size::human;
use anyhow::{bail, Context, Result};
use condense_api::Catalog;
use condense_estimate::image::{qemu_img, CheckedImage};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;

/// A private directory for the server's socket, removed on drop.
struct SocketDir(PathBuf);

impl SocketDir {
    fn new() -> Result<SocketDir> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let dir =
            std::env::temp_dir().join(format!("condense-nbd-{}-{nanos:x}", std::process::id()));
        std::os::unix::fs::DirBuilderExt::mode(&mut std::fs::DirBuilder::new(), 0o700)
            .create(&dir)
            .with_context(|| format!("cannot create a socket directory {}", dir.display()))?;
        Ok(SocketDir(dir))
    }
    fn socket(&self) -> PathBuf {
        self.0.join("nbd.sock")
    }
}

impl Drop for SocketDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn nbd_uri(name: &str, socket: &Path) -> String {
    // Volume names are plain; escape what a URI path cannot hold.
    let mut escaped = String::new();
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            escaped.push(b as char);
        } else {
            escaped.push_str(&format!("%{b:02X}"));
        }
    }
    format!("nbd+unix:///{escaped}?socket={}", socket.display())
}

/// Run `qemu-img convert ARGS`; with `progress`, show its progress as a bar.
fn run_convert(args: &[std::ffi::OsString], progress: bool, what: &str) -> Result<()> {
    let mut cmd = qemu_img();
    cmd.arg("convert");
    if progress {
        cmd.arg("-p");
    }
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .context("cannot run qemu-img (install qemu-utils)")?;
    // Drain stderr on a thread so that a chatty qemu-img cannot block on a full pipe.
    let mut stderr = child.stderr.take().context("qemu-img stderr")?;
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let bar = if progress {
        let b = indicatif::ProgressBar::new(10_000);
        b.set_style(
            indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {percent}% {elapsed}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b.set_message(what.to_string());
        Some(b)
    } else {
        None
    };
    if let Some(mut stdout) = child.stdout.take() {
        // qemu-img -p prints "    (12.34/100%)" and a carriage return, over and over.
        let mut line = Vec::new();
        let mut buf = [0u8; 512];
        loop {
            let n = match stdout.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            for &c in &buf[..n] {
                if c == b'\r' || c == b'\n' {
                    if let (Some(b), Some(p)) = (&bar, parse_progress(&line)) {
                        b.set_position((p * 100.0) as u64);
                    }
                    line.clear();
                } else {
                    line.push(c);
                }
            }
        }
    }
    let status = child.wait().context("waiting for qemu-img")?;
    let err = err_reader.join().unwrap_or_default();
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    if !status.success() {
        bail!("qemu-img convert failed ({status}): {}", err.trim());
    }
    Ok(())
}

/// The percentage in one progress line of `qemu-img convert -p`.
pub fn parse_progress(line: &[u8]) -> Option<f64> {
    let s = std::str::from_utf8(line).ok()?.trim();
    let inner = s.strip_prefix('(')?.strip_suffix("/100%)")?;
    inner.trim().parse().ok()
}

/// Import a checked disk image (a format read through qemu-img) into a new volume `name`. On
/// failure the half-made volume is deleted.
pub fn import_image(
    catalog: Arc<dyn Catalog>,
    checked: &CheckedImage,
    name: &str,
    progress: bool,
) -> Result<()> {
    if !condense_nbd::is_exportable(name) {
        bail!("{name:?} cannot be a volume name for import (empty, or starts with '.')");
    }
    let image = checked.path.as_path();
    let usage_before = catalog.usage().context("cannot read pool usage")?;
    let bs = u64::from(usage_before.block_size.max(1));
    // The volume must be a whole number of blocks; the tail past the image reads zeros.
    let size = checked.virtual_size.div_ceil(bs) * bs;
    catalog
        .create(name, size)
        .with_context(|| format!("cannot create volume {name:?}"))?;
    let result = (|| -> Result<()> {
        let dir = SocketDir::new()?;
        let server = crate::serve::spawn_unix(catalog.clone(), &dir.socket())?;
        let mut args: Vec<std::ffi::OsString> =
            vec!["-n".into(), "--target-is-zero".into(), "-W".into()];
        args.extend(checked.qemu_args());
        args.extend([
            "-O".into(),
            "raw".into(),
            nbd_uri(name, &dir.socket()).into(),
        ]);
        let converted = run_convert(&args, progress, &format!("importing {name}"));
        // Shut down (and flush) whether or not qemu-img succeeded.
        let stopped = server.shutdown().context("stopping the import server");
        converted?;
        stopped?;
        Ok(())
    })();
    if let Err(e) = result {
        if let Err(d) = catalog.delete(name) {
            eprintln!("condense: could not delete the half-imported volume {name:?}: {d}");
        }
        return Err(e.context(format!("import of {} failed", image.display())));
    }
    catalog.flush().context("cannot flush the pool")?;
    let usage_after = catalog.usage().context("cannot read pool usage")?;
    let written = catalog
        .list()?
        .into_iter()
        .find(|v| v.name == name)
        .map(|v| v.written_bytes)
        .unwrap_or(0);
    let stored = usage_after
        .physical_bytes
        .saturating_sub(usage_before.physical_bytes);
    let saving = if written > 0 {
        100.0 * (1.0 - stored as f64 / written as f64)
    } else {
        100.0
    };
    println!(
        "imported {} ({}) as {name}: {} logical, {} of data, {} stored, saving {saving:.1}%",
        image.display(),
        checked.format,
        human(size),
        human(written),
        human(stored),
    );
    Ok(())
}

/// Export volume `name` to `out` in `format` (qcow2, raw, vmdk, vdi, vhdx, ...). Holes in the
/// volume stay unallocated in the image. Refuses to overwrite an existing file.
pub fn export_image(catalog: Arc<dyn Catalog>, name: &str, out: &Path, format: &str) -> Result<()> {
    if out.exists() {
        bail!("{} already exists; remove it first", out.display());
    }
    if !condense_nbd::is_exportable(name) {
        bail!("volume {name:?} cannot be exported (empty name, or internal)");
    }
    catalog
        .open(name)
        .with_context(|| format!("cannot open volume {name:?}"))?;
    // Made here, owner-only, for qemu-img to write into (it keeps an existing file's mode).
    drop(crate::image::create_private(out, false)?);
    let started = SocketDir::new().and_then(|dir| {
        let server = crate::serve::spawn_unix_with(catalog, &dir.socket(), true)?;
        Ok((dir, server))
    });
    let (dir, server) = match started {
        Ok(s) => s,
        Err(e) => {
            let _ = std::fs::remove_file(out);
            return Err(e);
        }
    };
    let mut args: Vec<std::ffi::OsString> =
        vec!["-f".into(), "raw".into(), "-O".into(), format.into()];
    if format == "raw" {
        args.push("-W".into());
    }
    args.push(nbd_uri(name, &dir.socket()).into());
    // qemu-img would read "nbd:x.qcow2" as a protocol; "./nbd:x.qcow2" is the file.
    if condense_estimate::image::looks_like_protocol(&out.to_string_lossy()) {
        args.push(Path::new(".").join(out).into_os_string());
    } else {
        args.push(out.as_os_str().to_owned());
    }
    let converted = run_convert(&args, true, &format!("exporting {name}"));
    let stopped = server.shutdown().context("stopping the export server");
    if let Err(e) = converted {
        let _ = std::fs::remove_file(out);
        return Err(e);
    }
    stopped?;
    let written = std::fs::metadata(out).map(|m| m.len()).unwrap_or(0);
    println!(
        "exported {name} to {} ({format}, {} file)",
        out.display(),
        human(written)
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_lines_parse() -> Result<()> {
        assert_eq!(parse_progress(b"    (12.50/100%)"), Some(12.5));
        assert_eq!(parse_progress(b"garbage"), None);
        Ok(())
    }

    #[test]
    fn uris_escape_names() {
        assert_eq!(
            nbd_uri("vm 1", Path::new("/tmp/s")),
            "nbd+unix:///vm%201?socket=/tmp/s"
        );
    }
}

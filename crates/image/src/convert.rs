//! Import and export of the image formats qemu-img knows (qcow2, vmdk, vdi, vhdx, vpc), through
//! `qemu-img convert` to or from an in-process NBD export on a private Unix socket (a directory
//! of its own, mode 0700, removed afterwards). Holes stay holes both ways because qemu-img
//! skips zero ranges and reads our block status.
//!
//! An imported image has been checked by `condense_estimate::image::open` (it reads no file
//! but itself, and is consistent), and qemu-img gets only the file that was checked: it
//! inherits its descriptor (`CheckedImage::share_with`), named by `CheckedImage::qemu_args`
//! with the format pinned, the local file driver, no backing file and no data file. An image
//! that changed while it was converted is refused, and its volume deleted.

use crate::error::{Error, Result};
use crate::export::create_private;
use crate::import::mark_importing;
use crate::{Progress, Unit};
use condense_api::size::human;
use condense_api::Catalog;
use condense_engine::Pool;
use condense_estimate::image::{qemu_img, CheckedImage};
use condense_nbd::{Endpoint, Server, ServerConfig, ServerHandle};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;

/// What an import through qemu-img did; its `Display` is the summary `condense import` prints.
#[derive(Debug, Clone)]
pub struct ConvertedImport {
    pub path: PathBuf,
    /// The image's format ("qcow2").
    pub format: String,
    pub volume: String,
    /// The volume's size in bytes.
    pub size: u64,
    /// Bytes of the volume written (not zeros).
    pub written: u64,
    /// How much the pool's stored bytes grew.
    pub stored: u64,
}

impl std::fmt::Display for ConvertedImport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let saving = if self.written > 0 {
            100.0 * (1.0 - self.stored as f64 / self.written as f64)
        } else {
            100.0
        };
        write!(
            f,
            "imported {} ({}) as {}: {} logical, {} of data, {} stored, saving {saving:.1}%",
            self.path.display(),
            self.format,
            self.volume,
            human(self.size),
            human(self.written),
            human(self.stored),
        )
    }
}

/// What an export through qemu-img did; its `Display` is the summary `condense export` prints.
#[derive(Debug, Clone)]
pub struct ConvertedExport {
    pub volume: String,
    pub path: PathBuf,
    pub format: String,
    /// The image file's size in bytes.
    pub file_size: u64,
}

impl std::fmt::Display for ConvertedExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exported {} to {} ({}, {} file)",
            self.volume,
            self.path.display(),
            self.format,
            human(self.file_size)
        )
    }
}

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
            .map_err(|source| Error::SocketDirectory {
                path: dir.clone(),
                source,
            })?;
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

/// Start an NBD server on the Unix socket `socket_path` in a thread of its own, for qemu-img
/// (read-only for an export, which never needs to write). Dropping or shutting down the handle
/// stops it (answering requests in flight) and flushes the pool.
pub fn serve_on_socket(
    catalog: Arc<dyn Catalog>,
    socket_path: &Path,
    read_only: bool,
) -> Result<ServerHandle> {
    let config = ServerConfig {
        read_only,
        ..ServerConfig::default()
    };
    let server = Server::bind(
        catalog,
        config,
        &[Endpoint::Unix(socket_path.to_path_buf())],
    )
    .map_err(|source| Error::Serve {
        path: socket_path.to_path_buf(),
        source,
    })?;
    server
        .spawn()
        .map_err(|source| Error::StartServer { source })
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

/// Run `qemu-img convert -p ARGS`, reporting its progress as step `what`; `image`, the source
/// of an import that ARGS names, is inherited by qemu-img.
fn run_convert(
    args: &[std::ffi::OsString],
    image: Option<&CheckedImage>,
    what: &str,
    progress: &dyn Progress,
) -> Result<()> {
    let mut cmd = qemu_img();
    if let Some(image) = image {
        image.share_with(&mut cmd);
    }
    cmd.arg("convert")
        .arg("-p")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|source| Error::RunQemuImg { source })?;
    // Drain stderr on a thread so that a chatty qemu-img cannot block on a full pipe.
    let err_reader = child.stderr.take().map(|mut stderr| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = stderr.read_to_string(&mut s);
            s
        })
    });
    progress.start(what, 10_000, Unit::HundredthsOfPercent);
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
                    if let Some(p) = parse_progress(&line) {
                        progress.set((p * 100.0) as u64);
                    }
                    line.clear();
                } else {
                    line.push(c);
                }
            }
        }
    }
    let status = child
        .wait()
        .map_err(|source| Error::WaitQemuImg { source })?;
    let err = err_reader.and_then(|r| r.join().ok()).unwrap_or_default();
    progress.finish();
    if !status.success() {
        return Err(Error::QemuImgFailed {
            status,
            message: err.trim().to_string(),
        });
    }
    Ok(())
}

/// The percentage in one progress line of `qemu-img convert -p`.
pub fn parse_progress(line: &[u8]) -> Option<f64> {
    let s = std::str::from_utf8(line).ok()?.trim();
    let inner = s.strip_prefix('(')?.strip_suffix("/100%)")?;
    inner.trim().parse().ok()
}

/// Import a checked disk image (a format read through qemu-img) into a new volume `name`,
/// marked as an import in progress until it is complete. On failure the half-made volume is
/// deleted.
pub fn import_image(
    pool: &Arc<Pool>,
    checked: &CheckedImage,
    name: &str,
    progress: &dyn Progress,
) -> Result<ConvertedImport> {
    mark_importing(pool, name, true)?;
    let imported = import_marked(pool.clone(), checked, name, progress);
    mark_importing(pool, name, false)?;
    imported
}

/// [`import_image`] once the volume is marked.
fn import_marked(
    catalog: Arc<dyn Catalog>,
    checked: &CheckedImage,
    name: &str,
    progress: &dyn Progress,
) -> Result<ConvertedImport> {
    if !condense_nbd::is_exportable(name) {
        return Err(Error::NotImportableName {
            volume: name.to_string(),
        });
    }
    let image = checked.path.as_path();
    let usage_before = catalog.usage().map_err(|source| Error::Usage { source })?;
    let bs = u64::from(usage_before.block_size.max(1));
    // The volume must be a whole number of blocks; the tail past the image reads zeros.
    let size = checked.virtual_size.div_ceil(bs) * bs;
    catalog
        .create(name, size)
        .map_err(|source| Error::CreateVolume {
            volume: name.to_string(),
            source: source.into(),
        })?;
    let converted = convert_into(&catalog, checked, name, progress).and_then(|()| {
        if checked.is_unchanged() {
            Ok(())
        } else {
            Err(Error::ImageChanged {
                path: image.to_path_buf(),
            })
        }
    });
    if let Err(e) = converted {
        if let Err(d) = catalog.delete(name) {
            progress.warn(&format!(
                "could not delete the half-imported volume {name:?}: {d}"
            ));
        }
        return Err(Error::ConvertFailed {
            path: image.to_path_buf(),
            source: Box::new(e),
        });
    }
    catalog
        .flush()
        .map_err(|source| Error::FlushPool { source })?;
    let usage_after = catalog.usage().map_err(|source| Error::Usage { source })?;
    let written = catalog
        .list()
        .map_err(|source| Error::ListVolumes { source })?
        .into_iter()
        .find(|v| v.name == name)
        .map(|v| v.written_bytes)
        .unwrap_or(0);
    Ok(ConvertedImport {
        path: image.to_path_buf(),
        format: checked.format.to_string(),
        volume: name.to_string(),
        size,
        written,
        stored: usage_after
            .physical_bytes
            .saturating_sub(usage_before.physical_bytes),
    })
}

/// Serve volume `name` on a private socket and have qemu-img write the image into it.
fn convert_into(
    catalog: &Arc<dyn Catalog>,
    checked: &CheckedImage,
    name: &str,
    progress: &dyn Progress,
) -> Result<()> {
    let dir = SocketDir::new()?;
    let server = serve_on_socket(catalog.clone(), &dir.socket(), false)?;
    let mut args: Vec<std::ffi::OsString> =
        vec!["-n".into(), "--target-is-zero".into(), "-W".into()];
    args.extend(checked.qemu_args());
    args.extend([
        "-O".into(),
        "raw".into(),
        nbd_uri(name, &dir.socket()).into(),
    ]);
    let converted = run_convert(&args, Some(checked), &format!("importing {name}"), progress);
    // Shut down (and flush) whether or not qemu-img succeeded.
    let stopped = server.shutdown().map_err(|source| Error::StopServer {
        direction: "import",
        source,
    });
    converted?;
    stopped
}

/// Export volume `name` to `out` in `format` (qcow2, raw, vmdk, vdi, vhdx, ...). Holes in the
/// volume stay unallocated in the image. An existing file is removed first with `force`, else
/// refused; on failure the new file is removed.
pub fn export_image(
    pool: Arc<Pool>,
    name: &str,
    out: &Path,
    format: &str,
    force: bool,
    progress: &dyn Progress,
) -> Result<ConvertedExport> {
    if force && out.exists() {
        std::fs::remove_file(out).map_err(|source| Error::Remove {
            path: out.to_path_buf(),
            source,
        })?;
    }
    if out.exists() {
        return Err(Error::OutputExists {
            path: out.to_path_buf(),
        });
    }
    if !condense_nbd::is_exportable(name) {
        return Err(Error::NotExportableName {
            volume: name.to_string(),
        });
    }
    let catalog: Arc<dyn Catalog> = pool;
    catalog.open(name).map_err(|source| Error::OpenVolume {
        volume: name.to_string(),
        source: source.into(),
    })?;
    // Made here, owner-only, for qemu-img to write into (it keeps an existing file's mode).
    drop(create_private(out, false)?);
    let started = SocketDir::new().and_then(|dir| {
        let server = serve_on_socket(catalog, &dir.socket(), true)?;
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
    let converted = run_convert(&args, None, &format!("exporting {name}"), progress);
    let stopped = server.shutdown().map_err(|source| Error::StopServer {
        direction: "export",
        source,
    });
    if let Err(e) = converted {
        let _ = std::fs::remove_file(out);
        return Err(e);
    }
    stopped?;
    Ok(ConvertedExport {
        volume: name.to_string(),
        path: out.to_path_buf(),
        format: format.to_string(),
        file_size: std::fs::metadata(out).map(|m| m.len()).unwrap_or(0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_lines_parse() {
        assert_eq!(parse_progress(b"    (12.50/100%)"), Some(12.5));
        assert_eq!(parse_progress(b"garbage"), None);
    }

    #[test]
    fn uris_escape_names() {
        assert_eq!(
            nbd_uri("vm 1", Path::new("/tmp/s")),
            "nbd+unix:///vm%201?socket=/tmp/s"
        );
    }

    #[test]
    fn the_socket_server_serves_and_flushes_on_shutdown() -> Result<(), Box<dyn std::error::Error>>
    {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("s.sock");
        let cat = Arc::new(condense_api::mem::MemCatalog::new(4096));
        cat.create("v", 1 << 20)?;
        let h = serve_on_socket(cat, &path, false)?;
        let mut s = std::os::unix::net::UnixStream::connect(&path)?;
        let mut greeting = [0u8; 18];
        std::io::Read::read_exact(&mut s, &mut greeting)?;
        assert_eq!(&greeting[..8], b"NBDMAGIC");
        drop(s);
        h.shutdown()?;
        assert!(!path.exists());
        Ok(())
    }
}

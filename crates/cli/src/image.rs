//! Raw disk images in and out: `condense import` and `condense export`, and the options that
//! say how an image file from outside is read (`--format`, `--allow-backing-file`; the checks
//! themselves are `condense_estimate::image`).
//!
//! Import reads only the data extents of a sparse file (SEEK_DATA/SEEK_HOLE), on a reader
//! thread that stays ahead of the engine, and writes them in 8 MiB pieces. From standard input
//! (`condense import -`) it reads the stream in 8 MiB pieces the same way and skips all-zero
//! blocks, which stay holes. The new volume is marked as importing until the end, so an
//! interrupted import is visible in `volume list`; a failed import deletes it again.
//! Export writes only Data extents into a file of the volume's size, so holes stay holes. It
//! writes a new file next to the target (`FILE.condense-partial-PID`) and renames it into place
//! only when complete and synced: a failed export (no space, an unreadable block) removes its
//! partial file and leaves FILE as it was, whether FILE existed or not. Only a regular file
//! (or nothing) is replaced, and only with --force.

use crate::report::bar;
use crate::size::human;
use anyhow::{bail, Context, Result};
use condense_api::ExtentKind;
use condense_engine::reduction::is_zero;
use condense_engine::{Pool, VolumeHandle};
use condense_estimate::image::ImageOptions;
use condense_estimate::probe::{converted_format, Format};
use indicatif::ProgressBar;
use std::fs::File;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Instant;

const PIECE: u64 = 8 << 20;

/// How `import` and `estimate` read an image file from outside.
#[derive(clap::Args, Debug, Clone)]
pub struct ImageFileArgs {
    /// The image's format: raw, qcow2, vmdk, vdi, vhdx or vpc (VHD). Default: recognized by
    /// its first bytes; a file with no known header is raw. Give it when you know what the file
    /// is, above all for raw disks of VMs: a guest can write what looks like an image header
    /// into the first sector of its own disk, and such a disk is refused unless it is declared
    /// with --format raw.
    #[arg(long, value_name = "FMT", value_parser = Format::parse)]
    pub format: Option<Format>,
    /// Let the image read the other files it names: a qcow2 backing file or external data
    /// file, the extent files of a VMDK descriptor, a VMDK parent. Without it such images are
    /// refused, because whoever made the image chooses those names (/etc/shadow, another VM's
    /// disk) and their content would end up in the volume. Dangerous with any image you did
    /// not make yourself (from a guest, a customer, a download).
    #[arg(long)]
    pub allow_backing_file: bool,
}

impl ImageFileArgs {
    pub fn options(&self) -> ImageOptions {
        ImageOptions {
            format: self.format,
            allow_backing_file: self.allow_backing_file,
        }
    }
}

/// The image format an output file name asks for.
pub fn format_from_extension(path: &Path) -> String {
    match path
        .extension()
        .and_then(|e| e.to_str())
        .map(|e| e.to_ascii_lowercase())
        .as_deref()
    {
        Some(e @ ("qcow2" | "vmdk" | "vdi" | "vhdx")) => e.to_string(),
        _ => "raw".to_string(),
    }
}

/// The data extents of a file: (offset, length), via SEEK_DATA/SEEK_HOLE.
fn data_extents(f: &File, size: u64) -> Vec<(u64, u64)> {
    let fd = f.as_raw_fd();
    let mut out = Vec::new();
    let mut pos: i64 = 0;
    while (pos as u64) < size {
        // SAFETY: lseek on a descriptor we own.
        let data = unsafe { libc::lseek(fd, pos, libc::SEEK_DATA) };
        if data < 0 {
            break; // ENXIO: no more data
        }
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        let end = if hole < 0 { size as i64 } else { hole };
        out.push((data as u64, (end - data) as u64));
        pos = end;
    }
    if out.is_empty() && size > 0 && pos == 0 {
        // SEEK_DATA unsupported: treat everything as data.
        let probe = unsafe { libc::lseek(fd, 0, libc::SEEK_DATA) };
        if probe < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) {
            out.push((0, size));
        }
    }
    out
}

pub fn import_raw(pool: &Pool, path: &Path, name: &str) -> Result<()> {
    let f = File::open(path).with_context(|| format!("cannot open image {}", path.display()))?;
    let size = f.metadata()?.len();
    let bs = u64::from(pool.block_size());
    if size == 0 {
        bail!("image {} is empty", path.display());
    }
    if size % bs != 0 {
        bail!(
            "image {} is {size} bytes, not a multiple of the pool's block size ({bs}); pad it with `truncate -s %{bs} {}` and retry",
            path.display(),
            path.display()
        );
    }
    let extents = data_extents(&f, size);
    let data_total: u64 = extents.iter().map(|e| e.1).sum();
    let source = ExtentSource {
        file: f,
        extents: extents.into_iter(),
        bs,
        next: None,
    };
    import_volume(
        pool,
        name,
        size,
        &path.display().to_string(),
        data_total,
        |progress| {
            copy_pieces(pool, name, source, false, progress)?;
            Ok((data_total, String::new()))
        },
    )
}

/// `condense import -`: a raw image of at most `size` bytes from standard input into a new
/// volume. All-zero blocks are skipped (they stay holes); if the input ends early, the rest of
/// the volume reads as zeros. More input than `size` is an error and nothing is kept. Input
/// that starts with an image header is refused unless `declared_raw` (`--format raw`).
pub fn import_stdin(pool: &Pool, name: &str, size: u64, declared_raw: bool) -> Result<()> {
    let bs = u64::from(pool.block_size());
    if size == 0 {
        bail!("--size must be more than 0");
    }
    if !size.is_multiple_of(bs) {
        bail!(
            "--size {} ({size} bytes) is not a multiple of the pool's block size ({bs}); use {} bytes",
            human(size),
            size.div_ceil(bs) * bs
        );
    }
    let source = StdinSource {
        input: std::io::stdin(),
        size,
        bs,
        read: 0,
        ended: false,
        declared_raw,
    };
    let imported = import_volume(pool, name, size, "standard input", size, |progress| {
        let source = copy_pieces(pool, name, source, true, progress)?;
        let read = source.read;
        if read == 0 {
            bail!("standard input was empty");
        }
        let note = if read < size {
            format!(
                "; the input ended after {} ({read} bytes): the remaining {} stay unwritten and read as zeros",
                human(read),
                human(size - read)
            )
        } else {
            String::new()
        };
        Ok((read, note))
    });
    let Err(e) = imported else {
        return Ok(());
    };
    let Some(&TooLong { read }) = e.chain().find_map(|c| c.downcast_ref::<TooLong>()) else {
        return Err(e);
    };
    // Nothing is kept at this point; count the rest of the input, so the error can say
    // which --size fits it.
    eprintln!(
        "condense: standard input is longer than --size {}; reading the rest to count it (Ctrl-C stops; nothing was kept)",
        human(size)
    );
    match std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink()) {
        Ok(rest) => {
            let total = read + rest;
            bail!(
                "import of standard input failed; nothing was kept: it holds {} ({total} bytes), {} bytes more than --size {} ({size} bytes); retry with --size {}",
                human(total),
                total - size,
                human(size),
                total.div_ceil(bs) * bs
            )
        }
        Err(r) => bail!(
            "import of standard input failed; nothing was kept: it holds more than --size {} ({size} bytes), at least {read} bytes (reading the rest failed: {r})",
            human(size)
        ),
    }
}

/// Create volume `name` of `size` bytes, fill it with `copy` (which returns the bytes it read
/// and a note for the summary), make it durable and print a summary. The volume is marked as
/// importing until it is complete; if `copy` fails, the volume is deleted again.
fn import_volume(
    pool: &Pool,
    name: &str,
    size: u64,
    source: &str,
    progress_total: u64,
    copy: impl FnOnce(&ProgressBar) -> Result<(u64, String)>,
) -> Result<()> {
    let before = pool.stats()?.physical_bytes;
    pool.create_volume(name, size)
        .with_context(|| format!("cannot create volume {name:?}"))?;
    pool.set_importing(name, true)?;
    let started = Instant::now();
    let progress = bar(progress_total, &format!("importing {name}"));
    let (read, note) = match copy(&progress) {
        Ok(r) => r,
        Err(e) => {
            progress.finish_and_clear();
            // Leave nothing half-made behind (a kill -9 cannot get here: then the volume
            // stays, marked as an incomplete import).
            let cleanup = pool.delete_volume(name);
            if let Err(c) = cleanup {
                eprintln!("condense: could not delete the half-imported volume {name:?}: {c}");
            }
            return Err(e.context(format!("import of {source} failed; nothing was kept")));
        }
    };
    pool.set_importing(name, false)?;
    pool.flush().context("making the import durable")?;
    progress.finish_and_clear();
    let secs = started.elapsed().as_secs_f64();
    let after = pool.stats()?;
    let added = after.physical_bytes.saturating_sub(before);
    let v = after.volumes.iter().find(|v| v.name == name);
    let written_bytes = v.map_or(0, |v| v.written_bytes);
    println!(
        "imported {source} into volume {name}: {} logical, {} of data read, {} non-zero; pool grew by {} ({:.1} % saved on this image); {:.1} s, {:.0} MB/s{note}",
        human(size),
        human(read),
        human(written_bytes),
        human(added),
        if written_bytes > 0 { 100.0 * (1.0 - added as f64 / written_bytes as f64) } else { 0.0 },
        secs,
        read as f64 / 1e6 / secs.max(1e-9)
    );
    Ok(())
}

/// Where the pieces of an image come from, read on a thread of their own.
trait PieceSource: Send + 'static {
    /// Fill `buf` (empty on entry) with the next piece, a whole number of blocks, and return
    /// its offset in the volume; `None` at the end.
    fn next_piece(&mut self, buf: &mut Vec<u8>) -> Result<Option<u64>>;
}

/// The data extents of a sparse file, aligned to blocks, in pieces of [`PIECE`].
struct ExtentSource {
    file: File,
    extents: std::vec::IntoIter<(u64, u64)>,
    bs: u64,
    /// The rest of the current extent: (position, end).
    next: Option<(u64, u64)>,
}

impl PieceSource for ExtentSource {
    fn next_piece(&mut self, buf: &mut Vec<u8>) -> Result<Option<u64>> {
        let (pos, end) = match self.next {
            Some(r) => r,
            None => {
                let Some((start, len)) = self.extents.next() else {
                    return Ok(None);
                };
                // Align to blocks: a data extent may start or end inside a block.
                (
                    start / self.bs * self.bs,
                    (start + len).div_ceil(self.bs) * self.bs,
                )
            }
        };
        let n = PIECE.min(end - pos);
        buf.resize(n as usize, 0);
        self.file
            .read_exact_at(buf, pos)
            .with_context(|| format!("reading the image at offset {pos}"))?;
        self.next = (pos + n < end).then_some((pos + n, end));
        Ok(Some(pos))
    }
}

/// A raw image on standard input, at most `size` bytes, in pieces of [`PIECE`].
struct StdinSource {
    input: std::io::Stdin,
    size: u64,
    bs: u64,
    /// Bytes read so far.
    read: u64,
    /// The input has ended.
    ended: bool,
    /// `--format raw`: an image header at the start is the guest's data, not a format.
    declared_raw: bool,
}

/// Standard input held more than --size: `read` bytes so far (the error path counts the rest).
#[derive(Debug)]
struct TooLong {
    read: u64,
}

impl std::fmt::Display for TooLong {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "standard input holds more than --size")
    }
}

impl std::error::Error for TooLong {}

impl PieceSource for StdinSource {
    fn next_piece(&mut self, buf: &mut Vec<u8>) -> Result<Option<u64>> {
        let pos = self.read;
        if self.ended {
            return Ok(None);
        }
        if pos == self.size {
            // Full: any further byte is one too many.
            buf.resize(PIECE as usize, 0);
            let extra = read_full(&mut self.input.lock(), buf).context("reading standard input")?;
            if extra > 0 {
                return Err(TooLong {
                    read: self.size + extra as u64,
                }
                .into());
            }
            return Ok(None);
        }
        buf.resize(PIECE.min(self.size - pos) as usize, 0);
        let n = read_full(&mut self.input.lock(), buf)
            .with_context(|| format!("reading standard input at byte {pos}"))?;
        if pos == 0 && !self.declared_raw {
            if let Some(format) = converted_format(&buf[..n]) {
                bail!(
                    "standard input starts like a {format} image, not raw; import it from a file (`condense import IMAGE`), or, if it is a raw disk whose first sector only looks like that (a guest can write one), pass --format raw"
                );
            }
        }
        self.read += n as u64;
        if n < buf.len() {
            // The end of the input: pad the last block with zeros.
            self.ended = true;
            let whole = (n as u64).div_ceil(self.bs) as usize * self.bs as usize;
            buf.truncate(whole);
            buf[n..].fill(0);
        }
        Ok((!buf.is_empty()).then_some(pos))
    }
}

/// Read until `buf` is full or the input ends; returns the bytes read.
fn read_full(input: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match input.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Write the pieces of `source` into volume `name`: a reader thread fills buffers ahead of
/// the engine, and buffers come back for reuse. With `skip_zero_blocks`, all-zero blocks are
/// not written (they stay holes). Returns the source once it is exhausted.
fn copy_pieces<S: PieceSource>(
    pool: &Pool,
    name: &str,
    mut source: S,
    skip_zero_blocks: bool,
    progress: &ProgressBar,
) -> Result<S> {
    let vol = pool.volume(name)?;
    let bs = pool.block_size() as usize;

    let (full_tx, full_rx) = mpsc::sync_channel::<(u64, Vec<u8>)>(3);
    let (empty_tx, empty_rx) = mpsc::channel::<Vec<u8>>();
    for _ in 0..4 {
        let _ = empty_tx.send(Vec::with_capacity(PIECE as usize));
    }
    let reader = std::thread::spawn(move || -> Result<S> {
        // Ends early, without error, when the writer has stopped (its error is reported).
        while let Ok(mut buf) = empty_rx.recv() {
            buf.clear();
            let Some(pos) = source.next_piece(&mut buf)? else {
                break;
            };
            if full_tx.send((pos, buf)).is_err() {
                break;
            }
        }
        Ok(source)
    });
    let mut done = 0u64;
    for (pos, buf) in full_rx {
        if skip_zero_blocks {
            write_nonzero_runs(&vol, pos, &buf, bs)
        } else {
            vol.write_at(pos, &buf, false)
        }
        .with_context(|| format!("writing volume {name:?} at offset {pos}"))?;
        done += buf.len() as u64;
        progress.set_position(done.min(progress.length().unwrap_or(done)));
        let _ = empty_tx.send(buf);
    }
    match reader.join() {
        Ok(r) => r,
        Err(_) => bail!("the image reader thread failed"),
    }
}

/// Write the runs of blocks of `buf` that are not all zeros, at `pos` and after.
fn write_nonzero_runs(
    vol: &VolumeHandle,
    pos: u64,
    buf: &[u8],
    bs: usize,
) -> condense_engine::Result<()> {
    let zero: Vec<bool> = buf.chunks(bs).map(is_zero).collect();
    let mut i = 0;
    while i < zero.len() {
        if zero[i] {
            i += 1;
            continue;
        }
        let start = i;
        while i < zero.len() && !zero[i] {
            i += 1;
        }
        vol.write_at(
            pos + (start * bs) as u64,
            &buf[start * bs..(i * bs).min(buf.len())],
            false,
        )?;
    }
    Ok(())
}

/// Open the export file `path` for writing: created mode 0600 whatever the umask (it holds a
/// volume's data: the owner decides who else gets it); with `replace`, an existing regular file
/// is truncated and made 0600 too before anything is written to it.
pub fn create_private(path: &Path, replace: bool) -> Result<File> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(replace)
        .create_new(!replace)
        .truncate(replace)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("cannot create {}", path.display()))?;
    let meta = file
        .metadata()
        .with_context(|| format!("cannot examine {}", path.display()))?;
    if meta.is_file() && meta.permissions().mode() & 0o077 != 0 {
        file.set_permissions(std::fs::Permissions::from_mode(0o600))
            .with_context(|| format!("cannot make {} owner-only (chmod 600)", path.display()))?;
    }
    Ok(file)
}

/// `condense export NAME FILE` as raw: a sparse file of the volume's size, written next to
/// FILE and renamed into place once complete (module documentation).
pub fn export_raw(pool: &Pool, name: &str, path: &Path, force: bool) -> Result<()> {
    let vol = pool
        .volume(name)
        .with_context(|| format!("cannot export volume {name:?}"))?;
    let size = vol.size()?;
    match std::fs::symlink_metadata(path) {
        Ok(m) if !m.is_file() => bail!(
            "{} exists and is not a regular file; export writes regular files only (to write a device, serve the volume and copy it with nbdcopy)",
            path.display()
        ),
        Ok(_) if !force => bail!("{} exists; pass --force to overwrite it", path.display()),
        _ => {}
    }
    let partial = partial_path(path);
    let out = create_private(&partial, false)
        .with_context(|| format!("cannot create {}", partial.display()))?;
    let written = write_raw(&vol, name, size, &out, &partial)
        .and_then(|data_total| place(&partial, path, force).map(|()| data_total));
    let data_total = match written {
        Ok(d) => d,
        Err(e) => {
            drop(out);
            if let Err(r) = std::fs::remove_file(&partial) {
                eprintln!(
                    "condense: could not remove the partial export {}: {r}",
                    partial.display()
                );
            }
            return Err(e.context(format!(
                "export of volume {name:?} failed; {} was left as it was",
                path.display()
            )));
        }
    };
    println!(
        "exported volume {name} to {}: {} logical, {} of data",
        path.display(),
        human(size),
        human(data_total)
    );
    Ok(())
}

/// Where an export to `path` is written until it is complete: `FILE.condense-partial-PID`,
/// in the same directory (so that the rename is atomic).
fn partial_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".condense-partial-{}", std::process::id()));
    path.with_file_name(name)
}

/// Write the volume's data extents into `out` (sized to `size`) and sync it; returns the
/// bytes of data written.
fn write_raw(vol: &VolumeHandle, name: &str, size: u64, out: &File, shown: &Path) -> Result<u64> {
    out.set_len(size)
        .with_context(|| format!("cannot size {} to {size} bytes", shown.display()))?;
    let extents = vol.extents(0, size)?;
    let data_total: u64 = extents
        .iter()
        .filter(|e| e.kind == ExtentKind::Data)
        .map(|e| e.len)
        .sum();
    let progress = bar(data_total, &format!("exporting {name}"));
    let mut buf = Vec::new();
    let mut done = 0u64;
    for e in extents.iter().filter(|e| e.kind == ExtentKind::Data) {
        let mut pos = e.offset;
        while pos < e.offset + e.len {
            let n = PIECE.min(e.offset + e.len - pos);
            buf.resize(n as usize, 0);
            vol.read_at(pos, &mut buf)
                .with_context(|| format!("reading volume {name:?} at offset {pos}"))?;
            out.write_all_at(&buf, pos)
                .with_context(|| format!("writing {} at offset {pos}", shown.display()))?;
            pos += n;
            done += n;
            progress.set_position(done);
        }
    }
    out.sync_all()
        .with_context(|| format!("syncing {}", shown.display()))?;
    progress.finish_and_clear();
    Ok(data_total)
}

/// Rename the complete export `partial` to `path`: replacing a file there only if `replace`,
/// and never one that appeared since the start (RENAME_NOREPLACE); then sync the directory.
fn place(partial: &Path, path: &Path, replace: bool) -> Result<()> {
    if replace {
        std::fs::rename(partial, path).with_context(|| {
            format!("cannot rename {} to {}", partial.display(), path.display())
        })?;
    } else {
        let from = std::ffi::CString::new(partial.as_os_str().as_bytes())?;
        let to = std::ffi::CString::new(path.as_os_str().as_bytes())?;
        // SAFETY: two NUL-terminated paths that live across the call.
        let rc = unsafe {
            libc::renameat2(
                libc::AT_FDCWD,
                from.as_ptr(),
                libc::AT_FDCWD,
                to.as_ptr(),
                libc::RENAME_NOREPLACE,
            )
        };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::EEXIST) => bail!(
                    "{} appeared during the export; pass --force to overwrite it",
                    path.display()
                ),
                // A file system without RENAME_NOREPLACE (some network and FUSE ones).
                Some(libc::EINVAL) if !path.exists() => std::fs::rename(partial, path)
                    .with_context(|| {
                        format!("cannot rename {} to {}", partial.display(), path.display())
                    })?,
                _ => {
                    return Err(err).with_context(|| {
                        format!("cannot rename {} to {}", partial.display(), path.display())
                    })
                }
            }
        }
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("syncing directory {}", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_exports_sit_beside_the_target() {
        let pid = std::process::id();
        assert_eq!(
            partial_path(Path::new("/srv/out.raw")),
            PathBuf::from(format!("/srv/out.raw.condense-partial-{pid}"))
        );
        assert_eq!(
            partial_path(Path::new("out.raw")),
            PathBuf::from(format!("out.raw.condense-partial-{pid}"))
        );
    }

    #[test]
    fn place_never_replaces_without_force() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let (partial, target) = (dir.path().join("p"), dir.path().join("t"));
        std::fs::write(&partial, b"new")?;
        std::fs::write(&target, b"old")?;
        assert!(place(&partial, &target, false).is_err());
        assert_eq!(std::fs::read(&target)?, b"old");
        place(&partial, &target, true)?;
        assert_eq!(std::fs::read(&target)?, b"new");
        assert!(!partial.exists());
        Ok(())
    }
}

//! Raw disk images in and out: `condense import` and `condense export`.
//!
//! Import reads only the data extents of a sparse file (SEEK_DATA/SEEK_HOLE), on a reader
//! thread that stays ahead of the engine, and writes them in 8 MiB pieces. From standard input
//! (`condense import -`) it reads the stream in 8 MiB pieces the same way and skips all-zero
//! blocks, which stay holes. The new volume is marked as importing until the end, so an
//! interrupted import is visible in `volume list`; a failed import deletes it again.
//! Export writes only Data extents into a file of the volume's size, so holes stay holes.

use crate::report::bar;
use crate::size::human;
use anyhow::{bail, Context, Result};
use condense_api::ExtentKind;
use condense_engine::reduction::is_zero;
use condense_engine::{Pool, VolumeHandle};
use condense_estimate::probe::converted_format;
pub use condense_estimate::probe::is_raw;
use indicatif::ProgressBar;
use std::fs::File;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::mpsc;
use std::time::Instant;

const PIECE: u64 = 8 << 20;

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

pub fn importing_key(name: &str) -> String {
    format!("cli/importing/{name}")
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
/// the volume reads as zeros. More input than `size` is an error and nothing is kept.
pub fn import_stdin(pool: &Pool, name: &str, size: u64) -> Result<()> {
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
    pool.meta_put(&importing_key(name), Some(b"1"))?;
    let started = Instant::now();
    let progress = bar(progress_total, &format!("importing {name}"));
    let (read, note) = match copy(&progress) {
        Ok(r) => r,
        Err(e) => {
            progress.finish_and_clear();
            // Leave nothing half-made behind (a kill -9 cannot get here: then the volume
            // stays, marked as an incomplete import).
            let cleanup = pool
                .delete_volume(name)
                .and_then(|_| pool.meta_put(&importing_key(name), None));
            if let Err(c) = cleanup {
                eprintln!("condense: could not delete the half-imported volume {name:?}: {c}");
            }
            return Err(e.context(format!("import of {source} failed; nothing was kept")));
        }
    };
    pool.meta_put(&importing_key(name), None)?;
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
        if pos == 0 {
            if let Some(format) = converted_format(&buf[..n]) {
                bail!(
                    "standard input is a {format} image, not raw; import it from a file (`condense import IMAGE`) or convert it to raw first (`qemu-img convert -O raw`)"
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

pub fn export_raw(pool: &Pool, name: &str, path: &Path, force: bool) -> Result<()> {
    let vol = pool
        .volume(name)
        .with_context(|| format!("cannot export volume {name:?}"))?;
    let size = vol.size()?;
    if path.exists() && !force {
        bail!("{} exists; pass --force to overwrite it", path.display());
    }
    let out = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .with_context(|| format!("cannot create {}", path.display()))?;
    out.set_len(size)
        .with_context(|| format!("cannot size {} to {size} bytes", path.display()))?;
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
                .with_context(|| format!("writing {} at offset {pos}", path.display()))?;
            pos += n;
            done += n;
            progress.set_position(done);
        }
    }
    out.sync_all()
        .with_context(|| format!("syncing {}", path.display()))?;
    progress.finish_and_clear();
    println!(
        "exported volume {name} to {}: {} logical, {} of data",
        path.display(),
        human(size),
        human(data_total)
    );
    Ok(())
}

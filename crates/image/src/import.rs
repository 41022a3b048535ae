//! Raw images into new volumes: a file (only its data extents are read, so holes stay holes)
//! or a stream on standard input (all-zero blocks are skipped and stay holes). A file is read
//! through the descriptor `condense_estimate::image::open` opened and checked, never by its
//! name again.
//!
//! The pieces are read on a thread that stays ahead of the engine ([`copy_pieces`]). The new
//! volume is marked as importing until the end, so an interrupted import is visible in `volume
//! list`; a failed import deletes it again and says "nothing was kept".

use crate::error::{Error, Result};
use crate::source::{data_extents, ExtentSource, PieceSource, StreamSource};
use crate::{Progress, Unit, PIECE};
use condense_api::size::human;
use condense_engine::reduction::is_zero;
use condense_engine::{Pool, VolumeHandle};
use condense_estimate::image::CheckedImage;
use std::io::Read;
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::time::Instant;

/// What an import of a raw image did; its `Display` is the summary `condense import` prints.
#[derive(Debug, Clone)]
pub struct ImportReport {
    /// Where the image came from: its path, or "standard input".
    pub source: String,
    pub volume: String,
    /// The volume's size in bytes.
    pub size: u64,
    /// Bytes of data read (the data extents of a file; what the stream held).
    pub read: u64,
    /// Bytes of the volume that are not zeros.
    pub nonzero: u64,
    /// How much the pool's stored bytes grew.
    pub pool_growth: u64,
    pub seconds: f64,
    /// The stream ended before the volume's size: the rest reads as zeros.
    pub ended_early: bool,
}

impl std::fmt::Display for ImportReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let saved = if self.nonzero > 0 {
            100.0 * (1.0 - self.pool_growth as f64 / self.nonzero as f64)
        } else {
            0.0
        };
        write!(
            f,
            "imported {} into volume {}: {} logical, {} of data read, {} non-zero; pool grew by {} ({saved:.1} % saved on this image); {:.1} s, {:.0} MB/s",
            self.source,
            self.volume,
            human(self.size),
            human(self.read),
            human(self.nonzero),
            human(self.pool_growth),
            self.seconds,
            self.read as f64 / 1e6 / self.seconds.max(1e-9)
        )?;
        if self.ended_early {
            write!(
                f,
                "; the input ended after {} ({} bytes): the remaining {} stay unwritten and read as zeros",
                human(self.read),
                self.read,
                human(self.size - self.read)
            )?;
        }
        Ok(())
    }
}

/// `condense import FILE` of a raw image, checked and opened by
/// `condense_estimate::image::open`: a new volume `name` of the file's size, holding its data
/// extents, read from the file that was opened.
pub fn import_raw(
    pool: &Pool,
    image: &CheckedImage,
    name: &str,
    progress: &dyn Progress,
) -> Result<ImportReport> {
    let path = image.path.as_path();
    let f = image.file().clone();
    let size = f
        .metadata()
        .map_err(|source| Error::ExamineImage {
            path: path.to_path_buf(),
            source,
        })?
        .len();
    let bs = u64::from(pool.block_size());
    if size == 0 {
        return Err(Error::EmptyImage {
            path: path.to_path_buf(),
        });
    }
    if size % bs != 0 {
        return Err(Error::ImageNotWholeBlocks {
            path: path.to_path_buf(),
            size,
            block_size: bs,
        });
    }
    let extents = data_extents(&f, size);
    let data_total: u64 = extents.iter().map(|e| e.1).sum();
    let source = ExtentSource::new(f, extents, bs);
    let what = path.display().to_string();
    import_volume(pool, name, size, &what, data_total, progress, |progress| {
        copy_pieces(pool, name, source, false, data_total, progress)?;
        Ok(data_total)
    })
}

/// `condense import -`: a raw image of at most `size` bytes from `input` (standard input) into
/// a new volume. All-zero blocks are skipped (they stay holes); if the input ends early, the
/// rest of the volume reads as zeros. More input than `size` is an error and nothing is kept
/// (the rest of the input is read to say which size fits it). Input that starts with an image
/// header is refused unless `declared_raw` (`--format raw`).
pub fn import_stdin<R: Read + Send + 'static>(
    pool: &Pool,
    name: &str,
    size: u64,
    declared_raw: bool,
    input: R,
    progress: &dyn Progress,
) -> Result<ImportReport> {
    let bs = u64::from(pool.block_size());
    if size == 0 {
        return Err(Error::ZeroSize);
    }
    if !size.is_multiple_of(bs) {
        return Err(Error::SizeNotWholeBlocks {
            size,
            block_size: bs,
        });
    }
    let input = Arc::new(Mutex::new(input));
    let source = StreamSource::new(input.clone(), size, bs, declared_raw);
    let imported = import_volume(
        pool,
        name,
        size,
        "standard input",
        size,
        progress,
        |progress| {
            let source = copy_pieces(pool, name, source, true, size, progress)?;
            match source.read {
                0 => Err(Error::EmptyInput),
                read => Ok(read),
            }
        },
    );
    let e = match imported {
        Ok(mut report) => {
            report.ended_early = report.read < size;
            return Ok(report);
        }
        Err(e) => e,
    };
    let Some(read) = too_long(&e) else {
        return Err(e);
    };
    // Nothing is kept at this point; count the rest of the input, so the error can say
    // which --size fits it.
    progress.warn(&format!(
        "standard input is longer than --size {}; reading the rest to count it (Ctrl-C stops; nothing was kept)",
        human(size)
    ));
    let mut input = input.lock().unwrap_or_else(PoisonError::into_inner);
    Err(match std::io::copy(&mut *input, &mut std::io::sink()) {
        Ok(rest) => {
            let total = read + rest;
            Error::InputLongerThanSize {
                total,
                size,
                fits: total.div_ceil(bs) * bs,
            }
        }
        Err(error) => Error::InputLongerUncounted { size, read, error },
    })
}

/// The bytes read so far, if `e` is (or wraps) a stream longer than its --size.
fn too_long(e: &Error) -> Option<u64> {
    match e {
        Error::InputTooLong { read } => Some(*read),
        Error::ImportFailed { source, .. } => too_long(source),
        _ => None,
    }
}

/// Create volume `name` of `size` bytes, fill it with `copy` (which returns the bytes it read),
/// make it durable and report. The volume is marked as importing until it is complete; if
/// `copy` fails, the volume is deleted again.
fn import_volume(
    pool: &Pool,
    name: &str,
    size: u64,
    what: &str,
    progress_total: u64,
    progress: &dyn Progress,
    copy: impl FnOnce(&dyn Progress) -> Result<u64>,
) -> Result<ImportReport> {
    // The pool's size and the volume's written bytes only: `stats()` would count the
    // per-volume figures, which every write of the import then keeps up to date (measured:
    // ~12 % of a corpus import's CPU, bench/README.md "Import without the figures").
    let before = pool
        .physical_bytes()
        .map_err(|source| Error::Stats { source })?;
    pool.create_volume(name, size)
        .map_err(|source| Error::CreateVolume {
            volume: name.to_string(),
            source: source.into(),
        })?;
    mark_importing(pool, name, true)?;
    let started = Instant::now();
    progress.start(&format!("importing {name}"), progress_total, Unit::Bytes);
    let read = match copy(progress) {
        Ok(r) => r,
        Err(e) => {
            progress.finish();
            // Leave nothing half-made behind (a kill -9 cannot get here: then the volume
            // stays, marked as an incomplete import).
            if let Err(c) = pool.delete_volume(name) {
                progress.warn(&format!(
                    "could not delete the half-imported volume {name:?}: {c}"
                ));
            }
            return Err(Error::ImportFailed {
                what: what.to_string(),
                source: Box::new(e),
            });
        }
    };
    mark_importing(pool, name, false)?;
    pool.flush()
        .map_err(|source| Error::MakeDurable { source })?;
    progress.finish();
    let seconds = started.elapsed().as_secs_f64();
    let after = pool
        .physical_bytes()
        .map_err(|source| Error::Stats { source })?;
    let nonzero = pool
        .volume_infos()
        .into_iter()
        .find(|v| v.name == name)
        .map_or(0, |v| v.written_bytes);
    Ok(ImportReport {
        source: what.to_string(),
        volume: name.to_string(),
        size,
        read,
        nonzero,
        pool_growth: after.saturating_sub(before),
        seconds,
        ended_early: false,
    })
}

/// Set or clear volume `name`'s "import in progress" mark (`engine::importing`).
pub(crate) fn mark_importing(pool: &Pool, name: &str, on: bool) -> Result<()> {
    pool.set_importing(name, on)
        .map_err(|source| Error::MarkImporting {
            volume: name.to_string(),
            source,
        })
}

/// Write the pieces of `source` into volume `name`: a reader thread fills buffers ahead of
/// the engine, and buffers come back for reuse. With `skip_zero_blocks`, all-zero blocks are
/// not written (they stay holes). Progress counts the bytes read, up to `total`. Returns the
/// source once it is exhausted.
fn copy_pieces<S: PieceSource>(
    pool: &Pool,
    name: &str,
    mut source: S,
    skip_zero_blocks: bool,
    total: u64,
    progress: &dyn Progress,
) -> Result<S> {
    let vol = pool.volume(name).map_err(|source| Error::OpenVolume {
        volume: name.to_string(),
        source: source.into(),
    })?;
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
        .map_err(|source| Error::WriteVolume {
            volume: name.to_string(),
            offset: pos,
            source,
        })?;
        done += buf.len() as u64;
        progress.set(done.min(total));
        let _ = empty_tx.send(buf);
    }
    reader.join().map_err(|_| Error::ReaderPanicked)?
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

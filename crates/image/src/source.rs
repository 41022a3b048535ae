//! Where the pieces of an imported image come from: the data extents of a sparse file
//! ([`ExtentSource`]) or a raw stream of at most a given size ([`StreamSource`]). Each piece is
//! a whole number of blocks, at most [`PIECE`] bytes, with its offset in the volume.

use crate::error::{Error, Result};
use crate::PIECE;
use condense_estimate::probe::converted_format;
use std::fs::File;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex, PoisonError};

/// Where the pieces of an image come from, read on a thread of their own.
pub(crate) trait PieceSource: Send + 'static {
    /// Fill `buf` (empty on entry) with the next piece, a whole number of blocks, and return
    /// its offset in the volume; `None` at the end.
    fn next_piece(&mut self, buf: &mut Vec<u8>) -> Result<Option<u64>>;
}

/// The data extents of a file: (offset, length), via SEEK_DATA/SEEK_HOLE.
pub(crate) fn data_extents(f: &File, size: u64) -> Vec<(u64, u64)> {
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

/// The data extents of a sparse file, aligned to blocks, in pieces of [`PIECE`]. The file is
/// the one that was opened and checked (`CheckedImage::file`), never reopened by name.
pub(crate) struct ExtentSource {
    file: Arc<File>,
    extents: std::vec::IntoIter<(u64, u64)>,
    bs: u64,
    /// The rest of the current extent: (position, end).
    next: Option<(u64, u64)>,
}

impl ExtentSource {
    pub(crate) fn new(file: Arc<File>, extents: Vec<(u64, u64)>, block_size: u64) -> ExtentSource {
        ExtentSource {
            file,
            extents: extents.into_iter(),
            bs: block_size,
            next: None,
        }
    }
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
            .map_err(|source| Error::ReadImage {
                offset: pos,
                source,
            })?;
        self.next = (pos + n < end).then_some((pos + n, end));
        Ok(Some(pos))
    }
}

/// A raw image streamed in (standard input), at most `size` bytes, in pieces of [`PIECE`].
pub(crate) struct StreamSource<R> {
    /// Shared with the caller, which reads the rest of a stream that was too long to count it.
    pub(crate) input: Arc<Mutex<R>>,
    size: u64,
    bs: u64,
    /// Bytes read so far.
    pub(crate) read: u64,
    /// The input has ended.
    ended: bool,
    /// `--format raw`: an image header at the start is the guest's data, not a format.
    declared_raw: bool,
}

impl<R> StreamSource<R> {
    pub(crate) fn new(
        input: Arc<Mutex<R>>,
        size: u64,
        block_size: u64,
        declared_raw: bool,
    ) -> StreamSource<R> {
        StreamSource {
            input,
            size,
            bs: block_size,
            read: 0,
            ended: false,
            declared_raw,
        }
    }
}

impl<R: Read + Send + 'static> PieceSource for StreamSource<R> {
    fn next_piece(&mut self, buf: &mut Vec<u8>) -> Result<Option<u64>> {
        let pos = self.read;
        if self.ended {
            return Ok(None);
        }
        let mut input = self.input.lock().unwrap_or_else(PoisonError::into_inner);
        if pos == self.size {
            // Full: any further byte is one too many.
            buf.resize(PIECE as usize, 0);
            let extra = read_full(&mut *input, buf)
                .map_err(|source| Error::ReadInputPastSize { source })?;
            if extra > 0 {
                return Err(Error::InputTooLong {
                    read: self.size + extra as u64,
                });
            }
            return Ok(None);
        }
        buf.resize(PIECE.min(self.size - pos) as usize, 0);
        let n = read_full(&mut *input, buf).map_err(|source| Error::ReadInput {
            offset: pos,
            source,
        })?;
        if pos == 0 && !self.declared_raw {
            if let Some(format) = converted_format(&buf[..n]) {
                return Err(Error::InputIsImage { format });
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

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(bytes: Vec<u8>, size: u64, raw: bool) -> StreamSource<std::io::Cursor<Vec<u8>>> {
        StreamSource::new(
            Arc::new(Mutex::new(std::io::Cursor::new(bytes))),
            size,
            4096,
            raw,
        )
    }

    #[test]
    fn a_short_stream_ends_padded_to_a_block() -> Result<()> {
        let mut s = stream(vec![7; 5000], 1 << 20, false);
        let mut buf = Vec::new();
        assert_eq!(s.next_piece(&mut buf)?, Some(0));
        assert_eq!(buf.len(), 8192);
        assert!(buf[..5000].iter().all(|&b| b == 7) && buf[5000..].iter().all(|&b| b == 0));
        buf.clear();
        assert_eq!(s.next_piece(&mut buf)?, None);
        assert_eq!(s.read, 5000);
        Ok(())
    }

    #[test]
    fn a_stream_longer_than_its_size_is_refused() -> Result<()> {
        let mut s = stream(vec![1; 4096 + 10], 4096, false);
        let mut buf = Vec::new();
        assert_eq!(s.next_piece(&mut buf)?, Some(0));
        buf.clear();
        let e = s.next_piece(&mut buf);
        assert!(
            matches!(e, Err(Error::InputTooLong { read: 4106 })),
            "{e:?}"
        );
        Ok(())
    }

    #[test]
    fn an_image_header_on_the_stream_is_refused_unless_declared_raw() -> Result<()> {
        let mut qcow2 = b"QFI\xfb".to_vec();
        qcow2.resize(4096, 0);
        let mut buf = Vec::new();
        let e = stream(qcow2.clone(), 4096, false).next_piece(&mut buf);
        assert!(matches!(e, Err(Error::InputIsImage { .. })), "{e:?}");
        buf.clear();
        assert_eq!(stream(qcow2, 4096, true).next_piece(&mut buf)?, Some(0));
        Ok(())
    }
}

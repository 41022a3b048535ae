//! `lseek(SEEK_DATA)` / `lseek(SEEK_HOLE)` answered from block status.

use condense_api::{Extent, ExtentKind, VolumeError};
use fuser::Errno;

/// Block status is asked for in windows of this many bytes, so that one lseek on a huge,
/// fragmented volume never builds one huge extent list.
const WINDOW_BYTES: u64 = 1 << 30;

/// What to look for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Whence {
    Data,
    Hole,
}

impl Whence {
    pub fn from_raw(whence: i32) -> Option<Self> {
        match whence {
            libc::SEEK_DATA => Some(Whence::Data),
            libc::SEEK_HOLE => Some(Whence::Hole),
            _ => None,
        }
    }
}

/// The first offset at or after `offset` that starts data (or a hole) in a file of `size` bytes
/// whose first `mapped` bytes are described by `status`; everything from `mapped` to `size` is a
/// hole. Zero and unmapped extents are holes. The end of the file counts as a hole.
pub fn seek(
    offset: u64,
    size: u64,
    mapped: u64,
    whence: Whence,
    mut status: impl FnMut(u64, u64) -> Result<Vec<Extent>, VolumeError>,
) -> Result<u64, Errno> {
    if offset >= size {
        return Err(Errno::ENXIO);
    }
    let mapped = mapped.min(size);
    let mut pos = offset;
    while pos < mapped {
        let len = (mapped - pos).min(WINDOW_BYTES);
        let extents = status(pos, len).map_err(|e| Errno::from_i32(e.errno()))?;
        let mut covered = pos;
        for e in extents {
            let end = e.offset.saturating_add(e.len).min(pos + len);
            if end <= pos {
                continue;
            }
            let start = e.offset.max(pos);
            let is_data = e.kind == ExtentKind::Data;
            if is_data == (whence == Whence::Data) {
                return Ok(start);
            }
            covered = covered.max(end);
        }
        if covered <= pos {
            // A reply that covers nothing would loop forever: treat the window as one kind.
            return Err(Errno::EIO);
        }
        pos = covered;
    }
    match whence {
        // Only holes remain.
        Whence::Data => Err(Errno::ENXIO),
        Whence::Hole => Ok(pos.max(offset).min(size)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use condense_api::mem::push_extent;

    /// A file of 10 blocks of 10 bytes: data in blocks 2..4 and 7, zero in 5.
    fn layout(off: u64, len: u64) -> Result<Vec<Extent>, VolumeError> {
        let mut out = Vec::new();
        for b in off / 10..(off + len).div_ceil(10) {
            let kind = match b {
                2 | 3 | 7 => ExtentKind::Data,
                5 => ExtentKind::Zero,
                _ => ExtentKind::Unmapped,
            };
            let start = (b * 10).max(off);
            let end = (b * 10 + 10).min(off + len);
            push_extent(&mut out, start, end - start, kind);
        }
        Ok(out)
    }

    #[test]
    fn data_and_holes() {
        let s = |off, w| seek(off, 100, 100, w, layout);
        assert_eq!(s(0, Whence::Data), Ok(20));
        assert_eq!(s(25, Whence::Data), Ok(25));
        assert_eq!(s(40, Whence::Data), Ok(70));
        assert_eq!(s(80, Whence::Data), Err(Errno::ENXIO));
        assert_eq!(s(0, Whence::Hole), Ok(0));
        assert_eq!(s(20, Whence::Hole), Ok(40));
        assert_eq!(s(70, Whence::Hole), Ok(80));
        assert_eq!(s(100, Whence::Hole), Err(Errno::ENXIO));
        assert_eq!(s(100, Whence::Data), Err(Errno::ENXIO));
    }

    #[test]
    fn unmapped_tail_and_eof_are_holes() {
        // Only the first 35 bytes are backed; the file is 60 bytes long.
        assert_eq!(seek(22, 60, 35, Whence::Hole, layout), Ok(35));
        assert_eq!(seek(36, 60, 35, Whence::Data, layout), Err(Errno::ENXIO));
        // All data up to the end: the hole is at the end of the file.
        let all = |off: u64, len: u64| {
            Ok(vec![Extent {
                offset: off,
                len,
                kind: ExtentKind::Data,
            }])
        };
        assert_eq!(seek(3, 50, 50, Whence::Hole, all), Ok(50));
    }

    #[test]
    fn an_empty_status_reply_is_an_error_not_a_loop() {
        assert_eq!(
            seek(0, 50, 50, Whence::Data, |_, _| Ok(Vec::new())),
            Err(Errno::EIO)
        );
    }
}

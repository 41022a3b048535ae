//! The segment store: append-only files of chunk records.
//!
//! Owns: which segment files exist, their lengths, and the one open segment new records go to.
//! Invariants:
//! - Only the open segment is ever written; every other segment is sealed and immutable
//!   (DESIGN.md invariant 4). Each pool open starts a new open segment, so a torn tail left by
//!   a crash is never appended to.
//! - Records are staged in `pending` and written with one `write_at` per batch. A batch is
//!   either written under the state lock ([`Segments::write_pending`]) or handed off
//!   ([`Segments::take_batch`]) to be written without it while other writes hash, look up and
//!   stage theirs; its records are applied (and so readable) only after its write succeeded
//!   ([`Segments::finish_batch`]). Batches are written in the order they were taken (the
//!   [`WriteOrder`] tickets), because consecutive direct batches share a page.
//! - A segment with batches in flight is not destaged, collected or cut to length until they
//!   are finished.
//! - Batches of at least [`DIRECT_BATCH_BYTES`] go to the open segment with direct I/O when
//!   the directory offers it: no copy into the page cache, which costs more CPU than hashing
//!   (a fresh page-cache page per 4 KiB of a file that only grows). Direct writes are whole
//!   aligned pages, so `pending` then starts at the page holding the end of what is written
//!   (those bytes are written again, unchanged, with the next batch), and the file ends in
//!   zeros up to the next page until the segment is sealed and cut to its length. Small
//!   batches go through the page cache as before; the kernel keeps the two coherent.
//! - A segment is reported dirty until the next flush syncs it.
//! - With a writeback cache tier, a segment lives in one of two directories: the pool's, or
//!   the cache's *staging* directory (fast device) until [`crate::destage`] has copied it to
//!   the pool's. New segments are staged while the staged bytes are under `staging_max`;
//!   past it they go straight to the pool directory. Only sealed segments are destaged, and
//!   a destaged copy replaces the staged one under the same id, byte for byte, so every
//!   chunk location stays valid.

use crate::error::{Error, Result};
use crate::format::{
    encode_record_into, encode_segment_header, segment_name, ChunkCodec, Fingerprint, Location,
    SEGMENT_HEADER_BYTES,
};
use crate::io::{AlignedBuf, Dir, DirectWriter, File, DIRECT_IO_ALIGN};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Condvar, Mutex};

/// The order batches are written in: each batch taken gets the next ticket and writes only
/// after the batch before it finished.
#[derive(Default)]
pub struct WriteOrder {
    /// The ticket whose turn it is.
    turn: Mutex<u64>,
    changed: Condvar,
}

impl WriteOrder {
    fn wait_turn(&self, ticket: u64) {
        let mut turn = crate::pool::lock(&self.turn);
        while *turn != ticket {
            turn = self.changed.wait(turn).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn done(&self, ticket: u64) {
        *crate::pool::lock(&self.turn) = ticket + 1;
        self.changed.notify_all();
    }
}

/// Records of the open segment handed off to be written without the state lock.
pub struct Batch {
    seg: u32,
    buf: AlignedBuf,
    /// File offset of `buf[0]`.
    at: u64,
    /// Where the segment's written bytes ended before this batch (`buf` holds the page
    /// around it again for a direct write).
    start: u64,
    file: Arc<dyn File>,
    direct: Option<Arc<dyn DirectWriter>>,
    /// The file system refused direct I/O: written through the page cache.
    fell_back: bool,
    ticket: u64,
    order: Arc<WriteOrder>,
    turn_taken: bool,
}

impl Batch {
    /// Where the segment's written bytes end after this batch.
    pub fn end(&self) -> u64 {
        self.at + self.buf.len() as u64
    }

    /// Write the batch, after every batch taken before it.
    pub fn write(&mut self) -> std::io::Result<()> {
        self.order.wait_turn(self.ticket);
        // Through the page cache: only the bytes after `start`.
        let buffered = |b: &Batch| {
            let skip = (b.start - b.at) as usize;
            b.file.write_at(&b.buf.as_slice()[skip..], b.start)
        };
        let r = match self.direct.clone() {
            None => buffered(self),
            Some(w) => match w.write_at(self.buf.padded(), self.at) {
                // Opened with O_DIRECT but refused at the write: through the page cache.
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    tracing::warn!(
                        "segment {}: direct I/O refused ({e}), writing through the page cache",
                        segment_name(self.seg)
                    );
                    self.fell_back = true;
                    buffered(self)
                }
                r => r,
            },
        };
        self.order.done(self.ticket);
        self.turn_taken = true;
        r
    }

    /// The batch's buffer (the batch is done with).
    fn buf_for_reuse(mut self) -> AlignedBuf {
        std::mem::take(&mut self.buf)
    }
}

impl Drop for Batch {
    /// A batch dropped unwritten still passes its turn on.
    fn drop(&mut self) {
        if !self.turn_taken {
            self.order.wait_turn(self.ticket);
            self.order.done(self.ticket);
        }
    }
}

/// A batch whose write failed.
pub struct BatchFailed {
    pub error: Error,
    /// The segment was put back as before the batch (nothing was staged after it): its
    /// chunk ids may be given back. Otherwise the pool must stop writing.
    pub rolled_back: bool,
}

pub struct SegmentFile {
    pub file: Arc<dyn File>,
    /// Bytes in the file (including any torn tail found at open).
    pub len: u64,
    /// In the staging directory (not yet destaged to the pool's).
    pub staged: bool,
}

/// Files written since the last flush, and which directories had names created since.
pub struct Dirty {
    pub files: Vec<Arc<dyn File>>,
    pub pool_dir: bool,
    pub staging_dir: bool,
}

/// Batches of at least this many bytes are written with direct I/O (see the module doc).
pub const DIRECT_BATCH_BYTES: u64 = 128 * 1024;

pub struct Segments {
    files: BTreeMap<u32, SegmentFile>,
    open: Option<u32>,
    next_id: u32,
    /// Bytes from `pending_base` on: first what is already written (or handed off) of the
    /// page holding the open segment's end (only with a direct writer), then the records
    /// not yet written.
    pending: AlignedBuf,
    /// Offset in the open segment where `pending` starts (page-aligned with a direct writer,
    /// else the open segment's length).
    pending_base: u64,
    /// The open segment's direct-I/O handle, if its directory offers one.
    writer: Option<Arc<dyn DirectWriter>>,
    /// Try direct I/O for new segments (off after a file system refused it).
    direct: bool,
    /// Batches taken and not yet finished, per segment.
    in_flight: BTreeMap<u32, usize>,
    /// Sealed segments to cut to their length once their batches are finished.
    cut_when_written: BTreeSet<u32>,
    order: Arc<WriteOrder>,
    next_ticket: u64,
    /// Buffers of finished batches, for the next ones.
    spare: Vec<AlignedBuf>,
    dirty: BTreeSet<u32>,
    names_changed: bool,
    staging_names_changed: bool,
    target_bytes: u64,
    uuid: [u8; 16],
    /// The writeback cache's directory, where new segments are staged (`None`: no staging).
    staging: Option<Arc<dyn Dir>>,
    staging_max: u64,
    /// The segment a destage is copying now.
    destaging: Option<u32>,
}

impl Segments {
    pub fn new(target_bytes: u64, uuid: [u8; 16]) -> Segments {
        Segments {
            files: BTreeMap::new(),
            open: None,
            next_id: 0,
            pending: AlignedBuf::new(),
            pending_base: 0,
            writer: None,
            direct: true,
            in_flight: BTreeMap::new(),
            cut_when_written: BTreeSet::new(),
            order: Arc::default(),
            next_ticket: 0,
            spare: Vec::new(),
            dirty: BTreeSet::new(),
            names_changed: false,
            staging_names_changed: false,
            target_bytes,
            uuid,
            staging: None,
            staging_max: 0,
            destaging: None,
        }
    }

    /// Register an existing segment found in the pool directory (or, `staged`, in the
    /// staging directory).
    pub fn add_existing(&mut self, id: u32, file: Arc<dyn File>, len: u64, staged: bool) {
        self.files.insert(id, SegmentFile { file, len, staged });
        self.next_id = self.next_id.max(id + 1);
    }

    /// Stage new segments in `dir` while fewer than `max` bytes are staged (`max` 0: create
    /// them in the pool directory from now on, while staged ones wait to be destaged; `None`
    /// only once nothing is staged).
    pub fn set_staging(&mut self, dir: Option<Arc<dyn Dir>>, max: u64) {
        self.staging = dir;
        self.staging_max = max;
    }

    pub fn staging(&self) -> Option<&Arc<dyn Dir>> {
        self.staging.as_ref()
    }

    /// New segments (and the journal) go to the staging directory.
    pub fn stages_new(&self) -> bool {
        self.staging.is_some() && self.staging_max > 0
    }

    /// Seal the open segment (the next record starts a new one). Call with nothing pending.
    pub fn seal_open(&mut self) -> Result<()> {
        debug_assert_eq!(self.next_offset(), self.written());
        let Some(open) = self.open.take() else {
            return Ok(());
        };
        self.pending.truncate(0);
        self.pending_base = 0;
        // Direct writes padded the file to a whole page: cut it to the segment's length, so
        // that a sealed segment is exactly its records.
        if self.writer.take().is_some() {
            if self.in_flight.contains_key(&open) {
                self.cut_when_written.insert(open);
            } else {
                self.cut_to_length(open)?;
            }
        }
        Ok(())
    }

    fn cut_to_length(&self, id: u32) -> Result<()> {
        let Some(seg) = self.files.get(&id) else {
            return Ok(());
        };
        let name = segment_name(id);
        let len = seg
            .file
            .len()
            .map_err(|e| Error::io(format!("reading the length of segment {name}"), e))?;
        if len > seg.len {
            seg.file
                .set_len(seg.len)
                .map_err(|e| Error::io(format!("cutting segment {name} to its length"), e))?;
        }
        Ok(())
    }

    /// Batches of segment `id` are being written.
    pub fn is_writing(&self, id: u32) -> bool {
        self.in_flight.contains_key(&id)
    }

    /// Bytes of records staged and not yet written or handed off.
    pub fn unwritten_bytes(&self) -> u64 {
        self.next_offset() - self.written()
    }

    /// Bytes of the open segment written to its file or handed off in a batch: its length.
    fn written(&self) -> u64 {
        self.open.map_or(0, |id| self.len_of(id))
    }

    /// Where the next record goes in the open segment.
    fn next_offset(&self) -> u64 {
        self.pending_base + self.pending.len() as u64
    }

    /// Bytes of the segments not yet destaged (the writeback cache's dirty bytes).
    pub fn staged_bytes(&self) -> u64 {
        self.files
            .values()
            .filter(|s| s.staged)
            .map(|s| s.len)
            .sum()
    }

    pub fn staged_count(&self) -> usize {
        self.files.values().filter(|s| s.staged).count()
    }

    /// Staged segments other than the open one with ids up to `max_id` (what a destage
    /// can still take).
    pub fn sealed_staged_through(&self, max_id: u32) -> usize {
        self.files
            .range(..=max_id)
            .filter(|(&id, s)| s.staged && Some(id) != self.open)
            .count()
    }

    /// The highest segment id handed out so far.
    pub fn last_id(&self) -> Option<u32> {
        self.next_id.checked_sub(1)
    }

    pub fn is_staged(&self, id: u32) -> bool {
        self.files.get(&id).is_some_and(|s| s.staged)
    }

    /// The oldest sealed staged segment to destage (marked as being destaged): its id, file
    /// and length. `None` if a destage is running or nothing sealed is staged.
    pub fn start_destage(&mut self) -> Option<(u32, Arc<dyn File>, u64)> {
        if self.destaging.is_some() {
            return None;
        }
        let (&id, s) = self.files.iter().find(|(&id, s)| {
            s.staged && Some(id) != self.open && !self.in_flight.contains_key(&id)
        })?;
        self.destaging = Some(id);
        Some((id, s.file.clone(), s.len))
    }

    /// A destage of `id` ended: with `Some(file)` the segment now lives in the pool
    /// directory as `file`. Returns false if the segment was removed meanwhile (GC).
    pub fn end_destage(&mut self, id: u32, file: Option<Arc<dyn File>>) -> bool {
        self.destaging = None;
        let Some(s) = self.files.get_mut(&id) else {
            return false;
        };
        if let Some(file) = file {
            s.file = file;
            s.staged = false;
            self.dirty.remove(&id);
        }
        true
    }

    pub fn file(&self, id: u32) -> Option<Arc<dyn File>> {
        self.files.get(&id).map(|s| s.file.clone())
    }

    pub fn ids(&self) -> impl Iterator<Item = (u32, u64)> + '_ {
        self.files.iter().map(|(&id, s)| (id, s.len))
    }

    pub fn open_id(&self) -> Option<u32> {
        self.open
    }

    /// Total bytes of all segment files.
    pub fn total_bytes(&self) -> u64 {
        self.files.values().map(|s| s.len).sum()
    }

    /// Stage one record; returns where it will be. May seal the open segment and start a new
    /// one (writing out what was staged for the old one first).
    pub fn append(
        &mut self,
        dir: &dyn Dir,
        id: u64,
        fp: &Fingerprint,
        codec: ChunkCodec,
        payload: &[u8],
    ) -> Result<Location> {
        let record = crate::format::RECORD_HEADER_BYTES as u64 + payload.len() as u64;
        let seg = self.room_for(dir, record)?;
        let offset = self.next_offset();
        encode_record_into(
            self.pending.extend_by(record as usize),
            id,
            fp,
            codec,
            payload,
        );
        Ok(Location {
            segment: seg,
            offset: offset as u32,
            stored_len: payload.len() as u32,
            codec,
        })
    }

    /// Stage a record copied verbatim (GC relocation); returns its new location.
    pub fn append_raw(&mut self, dir: &dyn Dir, record: &[u8], old: &Location) -> Result<Location> {
        let seg = self.room_for(dir, record.len() as u64)?;
        let offset = self.next_offset();
        self.pending.extend_from_slice(record);
        Ok(Location {
            segment: seg,
            offset: offset as u32,
            ..*old
        })
    }

    fn room_for(&mut self, dir: &dyn Dir, record: u64) -> Result<u32> {
        if let Some(open) = self.open {
            let end = self.next_offset();
            if end + record <= self.target_bytes || end == SEGMENT_HEADER_BYTES as u64 {
                return Ok(open);
            }
            self.write_pending()?;
            self.seal_open()?;
        }
        self.start_segment(dir)
    }

    fn start_segment(&mut self, dir: &dyn Dir) -> Result<u32> {
        let id = self.next_id;
        let name = segment_name(id);
        let staging = self
            .staging
            .clone()
            // A bucket takes whole objects only: an S3 pool stages every segment.
            .filter(|_| self.staged_bytes() < self.staging_max || dir.remote().is_some());
        let staged = staging.is_some();
        let dir: &dyn Dir = match &staging {
            Some(d) => &**d,
            None => dir,
        };
        let file = dir
            .open(&name, true)
            .map_err(|e| Error::io(format!("creating segment {name} in {}", dir.describe()), e))?;
        let header = encode_segment_header(id, &self.uuid);
        file.write_at(&header, 0)
            .map_err(|e| Error::io(format!("writing segment {name}"), e))?;
        self.writer = if self.direct {
            dir.open_direct(&name)
                .map_err(|e| Error::io(format!("opening segment {name} for direct I/O"), e))?
        } else {
            None
        };
        self.pending.truncate(0);
        if self.writer.is_some() {
            self.pending.extend_from_slice(&header);
            self.pending_base = 0;
        } else {
            self.pending_base = header.len() as u64;
        }
        self.next_id += 1;
        self.files.insert(
            id,
            SegmentFile {
                file,
                len: header.len() as u64,
                staged,
            },
        );
        self.open = Some(id);
        self.dirty.insert(id);
        if staged {
            self.staging_names_changed = true;
        } else {
            self.names_changed = true;
        }
        Ok(id)
    }

    /// Write staged records to the open segment now (under the state lock). On failure
    /// nothing staged is kept and the locations handed out since the last write must not be
    /// used.
    pub fn write_pending(&mut self) -> Result<()> {
        let Some(mut batch) = self.take_batch()? else {
            return Ok(());
        };
        let r = batch.write();
        self.finish_batch(batch, r).map_err(|f| f.error)
    }

    /// Hand the staged records off as a batch to write without the state lock; then call
    /// [`Segments::finish_batch`] (under the lock again) before using their locations.
    pub fn take_batch(&mut self) -> Result<Option<Batch>> {
        let end = self.next_offset();
        let written = self.written();
        if end == written {
            return Ok(None);
        }
        let Some(open) = self.open else {
            return Err(Error::Invalid(
                "records staged without an open segment".into(),
            ));
        };
        let Some(seg) = self.files.get_mut(&open) else {
            return Err(Error::Invalid(format!("open segment {open} missing")));
        };
        let direct = self
            .writer
            .clone()
            .filter(|_| end - written >= DIRECT_BATCH_BYTES);
        // The next batch starts with the page holding the end, for a direct write (or with
        // nothing).
        let keep_from = if self.writer.is_some() {
            end - end % DIRECT_IO_ALIGN as u64
        } else {
            end
        };
        let mut next = self.spare.pop().unwrap_or_default();
        next.truncate(0);
        next.extend_from_slice(
            &self.pending.as_slice()[(keep_from - self.pending_base) as usize..],
        );
        let buf = std::mem::replace(&mut self.pending, next);
        let batch = Batch {
            seg: open,
            buf,
            at: self.pending_base,
            start: written,
            file: seg.file.clone(),
            direct,
            fell_back: false,
            ticket: self.next_ticket,
            order: self.order.clone(),
            turn_taken: false,
        };
        self.next_ticket += 1;
        self.pending_base = keep_from;
        seg.len = end;
        *self.in_flight.entry(open).or_default() += 1;
        Ok(Some(batch))
    }

    /// A batch from [`Segments::take_batch`] was written (`result`). On success its
    /// records' locations may be used.
    pub fn finish_batch(
        &mut self,
        batch: Batch,
        result: std::io::Result<()>,
    ) -> std::result::Result<(), BatchFailed> {
        let id = batch.seg;
        if let Some(n) = self.in_flight.get_mut(&id) {
            *n -= 1;
            if *n == 0 {
                self.in_flight.remove(&id);
            }
        }
        if batch.fell_back {
            self.direct = false;
            if self.open == Some(id) {
                self.writer = None;
            }
        }
        let end = batch.end();
        match result {
            Ok(()) => {
                self.dirty.insert(id);
                let written = !self.in_flight.contains_key(&id);
                let mut buf = batch.buf_for_reuse();
                if self.spare.len() < 2 {
                    buf.truncate(0);
                    self.spare.push(buf);
                }
                if written && self.cut_when_written.remove(&id) {
                    self.cut_to_length(id).map_err(|error| BatchFailed {
                        error,
                        rolled_back: false,
                    })?;
                }
                Ok(())
            }
            Err(e) => {
                let error = Error::io(format!("writing segment {}", segment_name(id)), e);
                // Nothing staged or handed off after it: put the segment back as before.
                let last =
                    self.open == Some(id) && self.written() == end && self.next_offset() == end;
                if last {
                    let (start, at) = (batch.start, batch.at);
                    let mut buf = batch.buf_for_reuse();
                    buf.truncate((start - at) as usize);
                    self.pending = buf;
                    self.pending_base = at;
                    if let Some(seg) = self.files.get_mut(&id) {
                        seg.len = start;
                    }
                }
                Err(BatchFailed {
                    error,
                    rolled_back: last,
                })
            }
        }
    }

    /// Forget staged records (after a failed batch).
    pub fn discard_pending(&mut self) {
        self.pending
            .truncate((self.written() - self.pending_base) as usize);
    }

    /// Segment files written since the last call, and whether names were created since.
    pub fn take_dirty(&mut self) -> Dirty {
        let files = std::mem::take(&mut self.dirty)
            .into_iter()
            .filter_map(|id| self.file(id))
            .collect();
        Dirty {
            files,
            pool_dir: std::mem::take(&mut self.names_changed),
            staging_dir: std::mem::take(&mut self.staging_names_changed),
        }
    }

    /// Delete segment `id`'s file (from the pool directory `dir` or the staging directory)
    /// and forget it. The caller syncs the directory.
    pub fn remove(&mut self, dir: &dyn Dir, id: u32) -> Result<()> {
        let name = segment_name(id);
        let staged = self.is_staged(id);
        let dir: &dyn Dir = match (&self.staging, staged) {
            (Some(d), true) => &**d,
            _ => dir,
        };
        if staged && self.staging.is_none() {
            return Err(Error::Invalid(format!(
                "segment {name} is staged but no staging directory is set"
            )));
        }
        dir.remove(&name).map_err(|e| {
            Error::io(
                format!("removing segment {name} from {}", dir.describe()),
                e,
            )
        })?;
        self.files.remove(&id);
        self.dirty.remove(&id);
        if staged {
            self.staging_names_changed = true;
        }
        Ok(())
    }

    pub fn len_of(&self, id: u32) -> u64 {
        self.files.get(&id).map_or(0, |s| s.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::{SimDir, SimHandle};

    fn record(segs: &mut Segments, dir: &dyn Dir, id: u64) -> Result<Location> {
        segs.append(dir, id, &[id as u8; 16], ChunkCodec::Raw, &[id as u8; 4096])
    }

    /// GC and destage skip a segment while a batch taken from it is being written; it is
    /// theirs again once the batch is finished.
    #[test]
    fn a_segment_with_a_batch_in_flight_is_neither_destaged_nor_collectable() -> Result<()> {
        let pool = SimHandle(SimDir::new());
        let staging: Arc<dyn Dir> = Arc::new(SimHandle(SimDir::new()));
        // Room for two records a segment.
        let mut segs = Segments::new(64 + 2 * (32 + 4096), [7; 16]);
        segs.set_staging(Some(staging), 1 << 30);
        let first = record(&mut segs, &pool, 0)?;
        let mut batch = segs
            .take_batch()?
            .ok_or(Error::Invalid("no batch".into()))?;
        // Fill the segment and start the next: the first is sealed with the batch in flight.
        record(&mut segs, &pool, 1)?;
        let next = {
            // The sealing write waits for the batch before it: write that one first.
            let written = batch.write();
            let loc = record(&mut segs, &pool, 2)?;
            assert!(segs.is_writing(first.segment));
            assert_ne!(segs.open_id(), Some(first.segment));
            assert!(
                segs.start_destage().is_none(),
                "destaged with a batch in flight"
            );
            segs.finish_batch(batch, written).map_err(|f| f.error)?;
            loc
        };
        assert_ne!(next.segment, first.segment);
        assert!(!segs.is_writing(first.segment));
        let (id, _, _) = segs
            .start_destage()
            .ok_or(Error::Invalid("nothing to destage".into()))?;
        assert_eq!(id, first.segment);
        Ok(())
    }
}

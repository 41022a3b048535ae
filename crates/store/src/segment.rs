//! The segment store: append-only files of chunk records.
//!
//! Owns: which segment files exist, their lengths, the one open segment new records go to,
//! and the records on their way to it (pending in memory or being written). ("Staging" in
//! this code means only the writeback staging layer, crate::staging.)
//! Invariants:
//! - Only the open segment is ever written; every other segment is sealed and immutable
//!   (docs/DESIGN.md invariant 4). Each pool open starts a new open segment, so a torn tail left by
//!   a crash is never appended to.
//! - Records are appended to `pending` and written a batch at a time: once a batch's worth
//!   ([`DIRECT_BATCH_BYTES`]) is pending, at a flush, or when the segment is sealed. A record is
//!   readable from the moment it is appended: [`Segments::in_memory`] serves it from `pending`
//!   or from a batch not yet written, the file afterwards. Nothing a flush promises depends
//!   on that: a flush writes and waits for every batch, then syncs ([`Segments::take_dirty`]).
//! - Where the directory offers direct I/O, batches are written by one background thread
//!   (the segment writer), in the order they were appended, while writers go on hashing and
//!   appending (at most [`MAX_QUEUED_BYTES`] queued), except the last batch of a flush, which
//!   the flush writes itself once the queue is empty ([`Segments::write_all`]); elsewhere
//!   (the simulator, S3 staging without direct I/O) under the state lock, at once. So
//!   batches reach a file in the order of their records everywhere. A failed batch write poisons the
//!   pool: records of writes already acknowledged were in it.
//! - A segment with batches not yet finished is not destaged, collected or cut to length.
//! - Batches of at least [`DIRECT_BATCH_BYTES`] go to the open segment with direct I/O when
//!   the directory offers it: no copy into the page cache, which costs more CPU than hashing
//!   (a fresh page-cache page per 4 KiB of a file that only grows). Direct writes are whole
//!   aligned pages, so `pending` then starts at the page holding the end of what is written
//!   (those bytes are written again, unchanged, with the next batch), and the file ends in
//!   zeros up to the next page until the segment is sealed and cut to its length. Small
//!   batches go through the page cache; the kernel keeps the two coherent.
//! - A segment is reported dirty until the next flush syncs it.
//! - Which directory a segment file is in (a writeback cache's, or the pool's) is the
//!   staging layer's business ([`crate::staging`]): segments are opened, created and removed
//!   through the pool's directory only. A sealed segment whose batches are all written may
//!   be moved down by `condense_engine::pool::destage` ([`Segments::start_destage`]); the move keeps its id
//!   and bytes, so every chunk location stays valid.

use crate::io::{AlignedBuf, Dir, DirectWriter, File, DIRECT_IO_ALIGN};
use condense_format::error::{Error, Result};
use condense_format::locks::lock;
use condense_format::{
    encode_record_into, encode_segment_header, segment_name, segment_slot, ChunkCodec, Fingerprint,
    Location, SEGMENT_HEADER_BYTES, SEGMENT_SLOT_SHIFT,
};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Condvar, Mutex};

/// Records of the open segment on their way to its file.
struct Batch {
    seg: u32,
    /// With a direct writer: zeros after the end up to the next page.
    buf: AlignedBuf,
    /// File offset of `buf[0]`.
    at: u64,
    /// Where the segment's written bytes ended before this batch (`buf` holds the page
    /// around it again for a direct write).
    start: u64,
    file: Arc<dyn File>,
    direct: Option<Arc<dyn DirectWriter>>,
}

/// What became of a batch.
struct Written {
    seg: u32,
    error: Option<String>,
    /// The file system refused direct I/O: written through the page cache.
    fell_back: bool,
    /// The batch's buffer, for the next ones.
    buf: Option<AlignedBuf>,
}

impl Batch {
    fn write(&self) -> Written {
        // Through the page cache: only the bytes after `start`.
        let buffered = || {
            let skip = (self.start - self.at) as usize;
            self.file.write_at(&self.buf.as_slice()[skip..], self.start)
        };
        let mut fell_back = false;
        let r = match &self.direct {
            None => buffered(),
            Some(w) => match w.write_at(self.buf.padded(), self.at) {
                // Opened with O_DIRECT but refused at the write: through the page cache.
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    tracing::warn!(
                        "segment {}: direct I/O refused ({e}), writing through the page cache",
                        segment_name(self.seg)
                    );
                    fell_back = true;
                    buffered()
                }
                r => r,
            },
        };
        Written {
            seg: self.seg,
            error: r
                .err()
                .map(|e| format!("writing segment {}: {e}", segment_name(self.seg))),
            fell_back,
            buf: None,
        }
    }

    /// The `len` bytes at `offset` of segment `seg`, if this batch holds them.
    fn holds(&self, seg: u32, offset: u64, len: u64) -> Option<&[u8]> {
        let from = offset.checked_sub(self.at)?;
        let bytes = self.buf.as_slice();
        (seg == self.seg && from + len <= bytes.len() as u64)
            .then(|| &bytes[from as usize..(from + len) as usize])
    }
}

/// Most bytes of batches queued for the segment writer; appending more waits for it.
pub const MAX_QUEUED_BYTES: u64 = 8 << 20;

/// Room a new batch buffer starts with: a 1 MiB write of records that do not compress, and
/// the page before it, without growing (moving) the buffer.
const BATCH_BUFFER_BYTES: usize = (1 << 20) + (1 << 18);

/// Buffers of written batches kept for the next ones (as many as the queue can hold).
const SPARE_BUFFERS: usize = 8;

#[derive(Default)]
struct Queue {
    /// Oldest first; the front one is being written.
    batches: VecDeque<Arc<Batch>>,
    written: Vec<Written>,
    /// Batches ever queued, and ever taken off the queue written (or failed).
    queued: u64,
    done: u64,
    stop: bool,
    /// Tests: the writer takes no batch while held.
    held: bool,
}

impl Queue {
    fn bytes(&self) -> u64 {
        self.batches.iter().map(|b| b.buf.len() as u64).sum()
    }
}

/// The batches queued for the segment writer thread, and the signal of their changes.
#[derive(Default)]
struct WriterQueue {
    queue: Mutex<Queue>,
    changed: Condvar,
}

impl WriterQueue {
    fn wait<'a>(&self, q: std::sync::MutexGuard<'a, Queue>) -> std::sync::MutexGuard<'a, Queue> {
        self.changed.wait(q).unwrap_or_else(|e| e.into_inner())
    }
}

/// A wait, without the caller's locks, for the segment writer to have written the batches
/// queued when it was made ([`Segments::hand_off_pending`]).
pub struct WrittenWait {
    shared: Arc<WriterQueue>,
    through: u64,
}

impl WrittenWait {
    /// Return once every batch queued before this wait was made is written (or failed: the
    /// next `write_all` reports it).
    pub fn wait(&self) {
        let mut q = lock(&self.shared.queue);
        while q.done < self.through && !q.batches.is_empty() {
            q = self.shared.wait(q);
        }
    }
}

/// The background thread that writes batches to segment files in the order they were
/// queued. Dropping it writes what is queued, then ends the thread.
struct SegmentWriter {
    shared: Arc<WriterQueue>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl SegmentWriter {
    fn start() -> Result<SegmentWriter> {
        let shared = Arc::new(WriterQueue::default());
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("condense-segw".into())
            .spawn(move || SegmentWriter::run(&s))
            .map_err(|e| Error::io("starting the segment writer thread", e))?;
        Ok(SegmentWriter {
            shared,
            thread: Some(thread),
        })
    }

    fn run(shared: &WriterQueue) {
        loop {
            let batch = {
                let mut q = lock(&shared.queue);
                loop {
                    if let Some(b) = q.batches.front().filter(|_| !q.held) {
                        break b.clone();
                    }
                    if q.stop && q.batches.is_empty() {
                        return;
                    }
                    q = shared.wait(q);
                }
            };
            let mut written = batch.write();
            let mut q = lock(&shared.queue);
            q.batches.pop_front();
            q.done += 1;
            written.buf = Arc::try_unwrap(batch).ok().map(|b| b.buf);
            q.written.push(written);
            shared.changed.notify_all();
        }
    }

    /// Queue a batch, after waiting while [`MAX_QUEUED_BYTES`] are queued.
    fn queue(&self, batch: Batch) {
        let mut q = lock(&self.shared.queue);
        while !q.batches.is_empty() && q.bytes() + batch.buf.len() as u64 > MAX_QUEUED_BYTES {
            q = self.shared.wait(q);
        }
        q.batches.push_back(Arc::new(batch));
        q.queued += 1;
        self.shared.changed.notify_all();
    }

    /// Wait until every queued batch is written.
    fn wait_idle(&self) {
        let mut q = lock(&self.shared.queue);
        while !q.batches.is_empty() {
            q = self.shared.wait(q);
        }
    }

    fn take_written(&self) -> Vec<Written> {
        std::mem::take(&mut lock(&self.shared.queue).written)
    }

    /// A copy of the `len` bytes at `offset` of segment `seg` if a queued batch holds them.
    fn copy_queued(&self, seg: u32, offset: u64, len: u64) -> Option<Vec<u8>> {
        let q = lock(&self.shared.queue);
        q.batches
            .iter()
            .rev()
            .find_map(|b| b.holds(seg, offset, len))
            .map(<[u8]>::to_vec)
    }

    #[cfg(test)]
    fn hold(&self, held: bool) {
        lock(&self.shared.queue).held = held;
        self.shared.changed.notify_all();
    }
}

impl Drop for SegmentWriter {
    fn drop(&mut self) {
        {
            let mut q = lock(&self.shared.queue);
            q.stop = true;
            q.held = false;
        }
        self.shared.changed.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

pub struct SegmentFile {
    pub file: Arc<dyn File>,
    /// Bytes in the file (including any torn tail found at open).
    pub len: u64,
}

/// Files written since the last flush, and whether names were created or removed since.
pub struct Dirty {
    pub files: Vec<Arc<dyn File>>,
    pub names_changed: bool,
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
    /// Writes batches in the background (started with the first direct-I/O segment).
    background: Option<SegmentWriter>,
    /// The first batch write that failed: the pool must stop writing.
    failed: Option<String>,
    /// Buffers of finished batches, for the next ones.
    spare: Vec<AlignedBuf>,
    dirty: BTreeSet<u32>,
    names_changed: bool,
    target_bytes: u64,
    uuid: [u8; 16],
    /// The segment a destage is moving down now.
    destaging: Option<u32>,
    /// This host's member slot: the high byte of every segment id it creates.
    slot: u8,
    /// Other hosts' segments that chunks of this pool refer to (read-only handles on their
    /// objects; docs/S3.md "Many hosts"): read, never written, listed, moved or removed.
    foreign: BTreeMap<u32, Arc<dyn File>>,
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
            background: None,
            failed: None,
            spare: Vec::new(),
            dirty: BTreeSet::new(),
            names_changed: false,
            target_bytes,
            uuid,
            destaging: None,
            slot: 0,
            foreign: BTreeMap::new(),
        }
    }

    /// Create segments in member slot `slot` from now on (ids `slot << 24 ..`).
    pub fn set_slot(&mut self, slot: u8) {
        self.slot = slot;
        self.next_id = self.next_id.max(u32::from(slot) << SEGMENT_SLOT_SHIFT);
    }

    /// Whether segment `id` is another host's.
    pub fn is_foreign(&self, id: u32) -> bool {
        segment_slot(id) != self.slot
    }

    /// Read another host's segment `id` through `file` from now on.
    pub fn add_foreign(&mut self, id: u32, file: Arc<dyn File>) {
        debug_assert!(self.is_foreign(id));
        self.foreign.insert(id, file);
    }

    /// Register an existing segment found in the pool directory.
    pub fn add_existing(&mut self, id: u32, file: Arc<dyn File>, len: u64) {
        self.files.insert(id, SegmentFile { file, len });
        // A file named seg-ffffffff.dat leaves no id: `start_segment` then refuses.
        self.next_id = self.next_id.max(id.saturating_add(1));
    }

    /// Seal the open segment (the next record starts a new one), after handing what is
    /// pending for it to be written.
    pub fn seal_open(&mut self) -> Result<()> {
        self.write_pending()?;
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

    /// Bytes of records appended and not yet written or handed off.
    fn unwritten_bytes(&self) -> u64 {
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

    /// The highest segment id handed out so far.
    pub fn last_id(&self) -> Option<u32> {
        self.next_id.checked_sub(1)
    }

    /// Whether segment `id` may be moved down now: it exists, is sealed, and every batch
    /// of it is written.
    fn settled(&self, id: u32) -> bool {
        self.files.contains_key(&id) && Some(id) != self.open && !self.in_flight.contains_key(&id)
    }

    /// The first of `held` (segment ids the staging layer holds, oldest first) that may be
    /// moved down now, marked as being destaged. `None` if a destage is running or none
    /// may be moved.
    pub fn start_destage(&mut self, held: impl IntoIterator<Item = u32>) -> Option<u32> {
        if self.destaging.is_some() {
            return None;
        }
        self.reap();
        let id = held.into_iter().find(|&id| self.settled(id))?;
        self.destaging = Some(id);
        Some(id)
    }

    /// A destage of `id` ended; `moved`: its file is durable in the pool directory, so a
    /// flush need not sync it again.
    pub fn end_destage(&mut self, id: u32, moved: bool) {
        debug_assert_eq!(self.destaging, Some(id));
        self.destaging = None;
        if moved {
            self.dirty.remove(&id);
        }
    }

    /// True if every chunk the batch introduces (or moves) is whole on disk: journal replay
    /// applies a batch only then.
    pub fn batch_data_present(
        &self,
        records: &[condense_format::JournalRecord],
        block_size: u32,
        crypto: Option<&condense_format::crypto::Crypto>,
    ) -> bool {
        records.iter().all(|r| match r {
            condense_format::JournalRecord::NewChunk { id, loc, .. }
            | condense_format::JournalRecord::NewDelta { id, loc, .. }
            | condense_format::JournalRecord::Relocate { id, loc } => {
                // Another host's record was in the bucket, under that host's root, before
                // this host journaled a reference to it: durable before the batch was.
                if self.is_foreign(loc.segment) {
                    return true;
                }
                let fp = match r {
                    condense_format::JournalRecord::NewChunk { fp, .. }
                    | condense_format::JournalRecord::NewDelta { fp, .. } => Some(fp),
                    _ => None,
                };
                let Some(file) = self.file(loc.segment) else {
                    return false;
                };
                let mut buf = vec![0u8; loc.record_bytes() as usize];
                if file.read_at(&mut buf, u64::from(loc.offset)).is_err() {
                    return false;
                }
                let Ok(payload) =
                    condense_format::open_record(&buf, *id, loc, crypto, fp, String::new)
                else {
                    return false;
                };
                if loc.codec.is_delta() {
                    // Its bases are other records: the record's checks and its header suffice.
                    return condense_format::reduction::DeltaPayload::parse(&payload, String::new)
                        .is_ok();
                }
                let mut out = vec![0u8; block_size as usize];
                condense_format::reduction::decompress(loc.codec, &payload, &mut out, String::new)
                    .is_ok()
            }
            _ => true,
        })
    }

    pub fn file(&self, id: u32) -> Option<Arc<dyn File>> {
        self.files
            .get(&id)
            .map(|s| s.file.clone())
            .or_else(|| self.foreign.get(&id).cloned())
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

    /// Append one record; returns where it will be. May seal the open segment and start a new
    /// one (writing out what was pending for the old one first).
    pub fn append(
        &mut self,
        dir: &dyn Dir,
        id: u64,
        fp: &Fingerprint,
        codec: ChunkCodec,
        payload: &[u8],
    ) -> Result<Location> {
        let record = condense_format::RECORD_HEADER_BYTES as u64 + payload.len() as u64;
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

    /// Append a record copied verbatim (GC relocation); returns its new location.
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
            self.seal_open()?;
        }
        self.start_segment(dir)
    }

    fn start_segment(&mut self, dir: &dyn Dir) -> Result<u32> {
        let id = self.next_id;
        let name = segment_name(id);
        if id == u32::MAX || self.files.contains_key(&id) || segment_slot(id) != self.slot {
            return Err(Error::corrupt(
                format!("segment {name}"),
                "no segment id is left after the highest one in the pool directory (a file \
                 named seg-ffffffff.dat?): a new segment would overwrite an existing one",
            ));
        }
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
        if self.writer.is_some() && self.background.is_none() {
            self.background = Some(SegmentWriter::start()?);
        }
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
            },
        );
        self.open = Some(id);
        self.dirty.insert(id);
        self.names_changed = true;
        Ok(id)
    }

    /// Hand the pending records to be written: queued for the segment writer, or written now
    /// (under the state lock) without one. An error means a batch failed to be written (now
    /// or before): records of acknowledged writes may be lost, the pool must stop writing.
    pub fn write_pending(&mut self) -> Result<()> {
        self.reap();
        if let Some(batch) = self.take_batch()? {
            match &self.background {
                Some(w) => w.queue(batch),
                None => {
                    let mut written = batch.write();
                    written.buf = Some(batch.buf);
                    self.finish(written);
                }
            }
        }
        self.check_written()
    }

    /// Write the pending records once a batch's worth is pending; otherwise they wait in
    /// memory (readable there) for more.
    pub fn write_full_batch(&mut self) -> Result<()> {
        if self.unwritten_bytes() >= DIRECT_BATCH_BYTES {
            self.write_pending()
        } else {
            self.check_written()
        }
    }

    /// Hand the pending records to the segment writer, and a wait for it to write everything
    /// queued so far, to be waited on without the state lock: the next [`Segments::write_all`]
    /// under it (a flush's, a checkpoint's) then waits only for what is appended meanwhile,
    /// not for megabytes of queued direct writes on a busy disk. `None` without a segment
    /// writer (the records were written here, at once).
    pub fn hand_off_pending(&mut self) -> Result<Option<WrittenWait>> {
        self.write_pending()?;
        Ok(self.background.as_ref().map(|w| WrittenWait {
            shared: w.shared.clone(),
            through: lock(&w.shared.queue).queued,
        }))
    }

    /// A wait for the batches queued for the segment writer now (the pending records stay
    /// pending), to be waited on without the state lock before a hold that writes or queues
    /// (a flush, a GC's copies): `None` if nothing is queued.
    pub fn queued_wait(&self) -> Option<WrittenWait> {
        let w = self.background.as_ref()?;
        let q = lock(&w.shared.queue);
        (!q.batches.is_empty()).then(|| WrittenWait {
            shared: w.shared.clone(),
            through: q.queued,
        })
    }

    /// Write every pending record and wait until all are in their files. What is queued is
    /// written first (the writer keeps their order); what is still pending is then written
    /// here rather than handed to the writer and waited for: for a flush after a small write
    /// that hand-off was two thread switches of the flush's latency.
    pub fn write_all(&mut self) -> Result<()> {
        if let Some(w) = &self.background {
            w.wait_idle();
        }
        self.reap();
        if let Some(batch) = self.take_batch()? {
            let mut written = batch.write();
            written.buf = Some(batch.buf);
            self.finish(written);
        }
        self.check_written()
    }

    /// The first batch write that failed, if one did.
    pub fn write_failure(&self) -> Option<&str> {
        self.failed.as_deref()
    }

    fn check_written(&self) -> Result<()> {
        match &self.failed {
            Some(f) => Err(Error::Poisoned(f.clone())),
            None => Ok(()),
        }
    }

    /// Move the pending records into a batch to write (the next `pending` starts with the
    /// page holding their end, for a direct write).
    fn take_batch(&mut self) -> Result<Option<Batch>> {
        let end = self.next_offset();
        let written = self.written();
        if end == written {
            return Ok(None);
        }
        let Some(open) = self.open else {
            return Err(Error::Invalid(
                "records appended without an open segment".into(),
            ));
        };
        let Some(seg) = self.files.get_mut(&open) else {
            return Err(Error::Invalid(format!("open segment {open} missing")));
        };
        let direct = self
            .writer
            .clone()
            .filter(|_| end - written >= DIRECT_BATCH_BYTES);
        let keep_from = if self.writer.is_some() {
            end - end % DIRECT_IO_ALIGN as u64
        } else {
            end
        };
        let mut next = self
            .spare
            .pop()
            .unwrap_or_else(|| AlignedBuf::with_capacity(BATCH_BUFFER_BYTES));
        next.truncate(0);
        next.extend_from_slice(
            &self.pending.as_slice()[(keep_from - self.pending_base) as usize..],
        );
        let mut buf = std::mem::replace(&mut self.pending, next);
        if direct.is_some() {
            buf.zero_padding();
        }
        let batch = Batch {
            seg: open,
            buf,
            at: self.pending_base,
            start: written,
            file: seg.file.clone(),
            direct,
        };
        self.pending_base = keep_from;
        seg.len = end;
        self.dirty.insert(open);
        *self.in_flight.entry(open).or_default() += 1;
        Ok(Some(batch))
    }

    /// Account for the batches the segment writer finished.
    pub fn reap(&mut self) {
        let done = match &self.background {
            Some(w) => w.take_written(),
            None => return,
        };
        for w in done {
            self.finish(w);
        }
    }

    /// A batch was written (or failed).
    fn finish(&mut self, w: Written) {
        let id = w.seg;
        if let Some(n) = self.in_flight.get_mut(&id) {
            *n -= 1;
            if *n == 0 {
                self.in_flight.remove(&id);
            }
        }
        if w.fell_back {
            self.direct = false;
            if self.open == Some(id) {
                self.writer = None;
            }
        }
        if let Some(e) = w.error {
            tracing::error!("{e}: the pool stops writing until it is reopened");
            self.failed.get_or_insert(e);
        }
        if let Some(mut buf) = w.buf {
            if self.spare.len() < SPARE_BUFFERS {
                buf.truncate(0);
                self.spare.push(buf);
            }
        }
        if !self.in_flight.contains_key(&id) && self.cut_when_written.remove(&id) {
            if let Err(e) = self.cut_to_length(id) {
                self.failed.get_or_insert(e.to_string());
            }
        }
    }

    /// A copy of the record at `loc` while it is pending or being written (not yet readable
    /// from its file).
    pub fn in_memory(&self, loc: &Location) -> Option<Vec<u8>> {
        let offset = u64::from(loc.offset);
        let len = loc.record_bytes();
        if self.open == Some(loc.segment)
            && offset >= self.pending_base
            && offset + len <= self.next_offset()
        {
            let from = (offset - self.pending_base) as usize;
            return Some(self.pending.as_slice()[from..from + len as usize].to_vec());
        }
        if !self.in_flight.contains_key(&loc.segment) {
            return None;
        }
        self.background
            .as_ref()?
            .copy_queued(loc.segment, offset, len)
    }

    /// Where the pending records stand now, to [`Segments::discard_since`] it.
    pub fn mark(&self) -> (Option<u32>, u64) {
        (self.open, self.next_offset())
    }

    /// Forget the records appended since `mark` (a write that failed before it was
    /// committed). Records of it already handed to be written stay, unreferenced.
    pub fn discard_since(&mut self, mark: (Option<u32>, u64)) {
        let keep = if self.open == mark.0 {
            mark.1.max(self.written())
        } else {
            self.written()
        };
        self.pending
            .truncate(keep.saturating_sub(self.pending_base) as usize);
    }

    /// Segment files written since the last call, and whether names were created since,
    /// once every pending record is written.
    pub fn take_dirty(&mut self) -> Result<Dirty> {
        self.write_all()?;
        let files = std::mem::take(&mut self.dirty)
            .into_iter()
            .filter_map(|id| self.file(id))
            .collect();
        Ok(Dirty {
            files,
            names_changed: std::mem::take(&mut self.names_changed),
        })
    }

    /// Delete segment `id`'s file from the pool directory `dir` and forget it. The caller
    /// syncs the directory.
    pub fn remove(&mut self, dir: &dyn Dir, id: u32) -> Result<()> {
        let name = segment_name(id);
        dir.remove(&name).map_err(|e| {
            Error::io(
                format!("removing segment {name} from {}", dir.describe()),
                e,
            )
        })?;
        self.files.remove(&id);
        self.dirty.remove(&id);
        self.names_changed = true;
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

    fn held(segs: &Segments, on: bool) {
        if let Some(w) = &segs.background {
            w.hold(on);
        }
    }

    /// While a batch waits for the segment writer: its records read from memory, its
    /// segment is neither destaged nor collectable (even once sealed); once written, both
    /// are the file's again.
    #[test]
    fn a_segment_with_a_batch_in_flight_is_neither_destaged_nor_collectable() -> Result<()> {
        let pool = SimHandle(SimDir::new());
        // Room for two records a segment.
        let mut segs = Segments::new(64 + 2 * (32 + 4096), [7; 16]);
        segs.background = Some(SegmentWriter::start()?);
        held(&segs, true);
        let first = record(&mut segs, &pool, 0)?;
        // Pending: read from `pending`.
        let pending = segs
            .in_memory(&first)
            .ok_or(Error::Invalid("not pending".into()))?;
        assert_eq!(&pending[pending.len() - 4096..], &[0u8; 4096][..]);
        segs.write_pending()?;
        // Queued, not written: read from the queue.
        assert!(segs.is_writing(first.segment));
        assert_eq!(segs.in_memory(&first).as_deref(), Some(&pending[..]));
        // Fill the segment and start the next: the first is sealed with its batches queued.
        record(&mut segs, &pool, 1)?;
        let next = record(&mut segs, &pool, 2)?;
        assert_ne!(next.segment, first.segment);
        assert_ne!(segs.open_id(), Some(first.segment));
        assert!(segs.is_writing(first.segment));
        let all = || [first.segment, next.segment];
        assert!(
            segs.start_destage(all()).is_none(),
            "destaged with a batch in flight"
        );
        held(&segs, false);
        segs.write_all()?;
        assert!(!segs.is_writing(first.segment));
        assert_eq!(segs.in_memory(&first), None, "written: read from the file");
        let file = segs
            .file(first.segment)
            .ok_or(Error::Invalid("gone".into()))?;
        let mut on_disk = vec![0u8; pending.len()];
        file.read_at(&mut on_disk, u64::from(first.offset))
            .map_err(|e| Error::io("reading back", e))?;
        assert_eq!(on_disk, pending);
        let id = segs
            .start_destage(all())
            .ok_or(Error::Invalid("nothing to destage".into()))?;
        assert_eq!(id, first.segment);
        // One destage at a time; the open segment is never one.
        assert_eq!(segs.start_destage(all()), None);
        segs.end_destage(id, true);
        assert_eq!(segs.start_destage([next.segment]), None);
        Ok(())
    }

    /// The waits made under the state lock and waited on without it: one for what is queued
    /// (none when nothing is), one after handing the pending records off; each returns only
    /// once the writer wrote those batches, and write_all then has nothing left to wait for.
    #[test]
    fn waits_for_queued_batches_end_when_they_are_written() -> Result<()> {
        let pool = SimHandle(SimDir::new());
        let mut segs = Segments::new(1 << 20, [7; 16]);
        segs.background = Some(SegmentWriter::start()?);
        let first = record(&mut segs, &pool, 0)?;
        assert!(segs.queued_wait().is_none(), "nothing queued yet");
        held(&segs, true);
        let wait = segs
            .hand_off_pending()?
            .ok_or(Error::Invalid("no writer".into()))?;
        assert!(segs.is_writing(first.segment));
        let queued = segs
            .queued_wait()
            .ok_or(Error::Invalid("no wait for the queued batch".into()))?;
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = std::thread::spawn(move || {
            wait.wait();
            queued.wait();
            let _ = tx.send(());
        });
        let early = rx.recv_timeout(std::time::Duration::from_millis(100));
        assert!(
            early.is_err(),
            "the wait ended before the batch was written"
        );
        held(&segs, false);
        rx.recv_timeout(std::time::Duration::from_secs(10))
            .map_err(|_| Error::Invalid("the wait did not end once written".into()))?;
        let _ = waiter.join();
        segs.reap();
        assert!(!segs.is_writing(first.segment));
        assert!(segs.queued_wait().is_none());
        Ok(())
    }

    /// Found writing the segment fuzz target: a segment named `seg-ffffffff.dat` overflowed the
    /// next id (a panic in debug builds; in release the next segment became id 0 and was
    /// written over the existing segment 0). Now the next new segment is refused.
    #[test]
    fn the_highest_segment_id_leaves_none_to_hand_out() -> Result<()> {
        let pool = SimHandle(SimDir::new());
        let mut segs = Segments::new(1 << 20, [7; 16]);
        let file = pool
            .open(&segment_name(u32::MAX), true)
            .map_err(|e| Error::io("creating", e))?;
        segs.add_existing(u32::MAX, file, 64);
        assert_eq!(segs.last_id(), Some(u32::MAX - 1));
        assert!(matches!(
            record(&mut segs, &pool, 0),
            Err(Error::Corrupt { .. })
        ));
        Ok(())
    }
}

//! The journal: the write-ahead log of metadata changes between checkpoints.
//!
//! Owns: one file per generation, `journal-<gen>.wal`: a header, then batches of
//! [`JournalRecord`]s, each batch with a sequence number and CRC-32C.
//! Invariants:
//! - Records are applied to the in-memory state in exactly the order they are appended here,
//!   and replay applies them through the same function, so replay rebuilds the same state.
//! - A batch is written whole at the end of the file and only becomes durable with `sync`.
//!   On replay the first batch that is short, fails its CRC or is out of sequence ends the
//!   journal (a torn tail from a crash); if a valid batch follows it, that is damage, not a
//!   crash, and opening fails rather than silently dropping acknowledged changes. Only
//!   `condense repair` (`condense_engine::repair`) replays past damage (salvage mode): it skips the
//!   damaged bytes, records them in [`ReplayReport::damaged`], and hands the later batches to
//!   `apply` marked as following damage.
//! - A flush ends its batch with the flush mark ([`JournalRecord::flush_mark`]), and a flush
//!   seals its batch only after the previous flush returned (the sync lock), having synced
//!   every record placed before it. So when two marked batches numbered at or after batch B
//!   are in the file, the first one's flush completed and B was acknowledged. A batch whose
//!   chunk records are not whole on disk ends the journal as a torn tail (its writes were
//!   never acknowledged) unless it was acknowledged: then the records were damaged after the
//!   flush, and opening fails and points to `condense repair`, which keeps everything valid and
//!   names the blocks lost.
//! - In an encrypted pool a batch's payload is sealed ([`condense_format::crypto`]) with its generation,
//!   sequence number and record count as associated data; a batch whose CRC holds but whose
//!   tag does not is tampering, and replay fails with an authentication error.

use condense_format::crypto::{Crypto, Kind};
use condense_format::error::{Error, Result};
use condense_format::{
    batch_valid, decode_batch_header, decode_journal_header, encode_batch, encode_journal_header,
    journal_name, JournalRecord, Reader, BATCH_HEADER_BYTES, JOURNAL_HEADER_BYTES,
};
use condense_store::io::{Dir, File};
use std::sync::Arc;

/// How [`Journal::replay`] treats the journal file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplayMode {
    /// A writable open: a torn tail is cut off the file.
    Writable,
    /// A read-only open: nothing is written.
    ReadOnly,
    /// `condense repair` (read-only): damage followed by a valid batch is skipped and recorded.
    Salvage,
}

pub struct Journal {
    pub gen: u64,
    pub file: Arc<dyn File>,
    /// End of the last batch written.
    len: u64,
    buf: Vec<u8>,
    count: u32,
    /// The buffered records end with the flush mark.
    marked: bool,
    next_seq: u64,
    /// Seals batches in an encrypted pool.
    crypto: Option<Arc<Crypto>>,
}

/// What replay found.
#[derive(Debug, Default)]
pub struct ReplayReport {
    pub batches: u64,
    pub records: u64,
    /// Bytes past the last valid batch (a torn tail), dropped.
    pub torn_bytes: u64,
    /// Salvage mode only: the damaged stretches skipped, in journal order.
    pub damaged: Vec<DamagedStretch>,
    /// Salvage mode only: what applying the batches after damage skipped.
    pub salvage: Salvage,
    /// What open found damaged and worked around, each said once: a copy of the superblock
    /// or root it did not use (condense_store::copies), a header it rebuilt. A writable open mended
    /// them on disk.
    pub notes: Vec<String>,
}

/// Bytes of a journal that hold no valid batch, with a valid batch after them.
#[derive(Clone, Debug, Default)]
pub struct DamagedStretch {
    /// The journal file.
    pub file: String,
    /// Where the damage starts and how many bytes until the next valid batch.
    pub offset: u64,
    pub bytes: u64,
    /// Sequence numbers of the batches lost: `first_seq..next_seq`.
    pub first_seq: u64,
    pub next_seq: u64,
    /// What could be decoded from the damaged bytes without their checksum (best effort:
    /// the bytes failed their check, so this says what the lost batches probably changed).
    pub records: Vec<JournalRecord>,
    /// Whether every batch in the stretch decoded; if not, some of the lost writes are
    /// unknown.
    pub decoded_whole: bool,
}

impl Journal {
    /// Create generation `gen` (header written, not synced).
    pub fn create(
        dir: &dyn Dir,
        gen: u64,
        uuid: &[u8; 16],
        next_seq: u64,
        crypto: Option<Arc<Crypto>>,
    ) -> Result<Journal> {
        let file = Journal::create_file(dir, gen, uuid)?;
        Ok(Journal::with_file(gen, file, next_seq, crypto))
    }

    /// Generation `gen`'s file, made empty but for its header: the part of
    /// [`Journal::create`] that touches the file system, which a checkpoint does before it
    /// takes the state lock (creating a file can wait for the file system's journal).
    pub fn create_file(dir: &dyn Dir, gen: u64, uuid: &[u8; 16]) -> Result<Arc<dyn File>> {
        let name = journal_name(gen);
        let file = dir
            .open(&name, true)
            .map_err(|e| Error::io(format!("creating journal {name}"), e))?;
        let header = encode_journal_header(gen, uuid);
        file.set_len(0)
            .and_then(|_| file.write_at(&header, 0))
            .map_err(|e| Error::io(format!("writing journal {name}"), e))?;
        Ok(file)
    }

    /// The journal of generation `gen` over `file`, made by [`Journal::create_file`] for it.
    pub fn with_file(
        gen: u64,
        file: Arc<dyn File>,
        next_seq: u64,
        crypto: Option<Arc<Crypto>>,
    ) -> Journal {
        Journal {
            gen,
            file,
            len: JOURNAL_HEADER_BYTES as u64,
            buf: Vec::new(),
            count: 0,
            marked: false,
            next_seq,
            crypto,
        }
    }

    /// Open generation `gen` and hand every valid batch to `apply` in order. `apply` returns
    /// false if the batch refers to data that is not on disk (its writes were never
    /// acknowledged), which ends the journal there like a torn tail. With [`ReplayMode::Salvage`] (only
    /// for `condense repair`, on a read-only open), damage followed by a valid batch is
    /// skipped and recorded instead of failing, and `apply` gets `true` as its second
    /// argument for every batch after the first damage.
    pub fn replay(
        dir: &dyn Dir,
        gen: u64,
        uuid: &[u8; 16],
        first_seq: u64,
        mode: ReplayMode,
        crypto: Option<Arc<Crypto>>,
        mut apply: impl FnMut(Vec<JournalRecord>, bool) -> Result<bool>,
    ) -> Result<(Journal, ReplayReport)> {
        let name = journal_name(gen);
        let file = dir.open(&name, false).map_err(|e| {
            Error::io(
                format!("opening journal {name} named by the checkpoint (the pool is damaged; restore it from a backup)"),
                e,
            )
        })?;
        let flen = file
            .len()
            .map_err(|e| Error::io(format!("reading journal {name}"), e))?;
        let mut data = vec![0u8; flen as usize];
        file.read_at(&mut data, 0)
            .map_err(|e| Error::io(format!("reading journal {name}"), e))?;
        let mut r = Replay {
            name,
            data,
            gen,
            mode,
            crypto: crypto.as_deref(),
            report: ReplayReport::default(),
            pos: JOURNAL_HEADER_BYTES,
            seq: first_seq,
            unreadable: false,
            after_damage: false,
        };
        if condense_format::header_intact(&r.data) {
            r.check_header(uuid)?;
        } else {
            r.mend_header(&*file, uuid)?;
        }
        let flen = flen.max(JOURNAL_HEADER_BYTES as u64);
        r.apply_batches(&mut apply)?;
        r.check_nothing_after()?;
        let Replay {
            name,
            pos,
            seq,
            mut report,
            ..
        } = r;
        // Batches end inside the file's bytes (its header's, when it was shorter).
        debug_assert!(pos as u64 <= flen);
        report.torn_bytes = flen - pos as u64;
        if report.torn_bytes > 0 && mode == ReplayMode::Writable {
            file.set_len(pos as u64)
                .and_then(|_| file.sync())
                .map_err(|e| Error::io(format!("truncating the torn tail of journal {name}"), e))?;
        }
        Ok((
            Journal {
                gen,
                file,
                len: pos as u64,
                buf: Vec::new(),
                count: 0,
                marked: false,
                next_seq: seq,
                crypto,
            },
            report,
        ))
    }

    pub fn append(&mut self, rec: &JournalRecord) {
        rec.encode(&mut self.buf);
        self.count += 1;
        self.marked = false;
    }

    /// Bytes appended but not yet written.
    pub fn pending_bytes(&self) -> usize {
        self.buf.len()
    }

    /// Bytes written to the file.
    pub fn file_bytes(&self) -> u64 {
        self.len
    }

    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// [`Journal::seal`] for a flush: the batch ends with the flush mark (see the module
    /// documentation), written even when nothing else is buffered.
    pub fn seal_flush(&mut self) -> Result<()> {
        if !self.marked {
            self.append(&JournalRecord::flush_mark());
            self.marked = true;
        }
        self.seal()
    }

    /// Write what was appended as one batch (not synced). On failure the records stay
    /// buffered and the call may be retried.
    pub fn seal(&mut self) -> Result<()> {
        if self.count == 0 {
            return Ok(());
        }
        let sealed;
        let payload = match &self.crypto {
            Some(c) => {
                sealed = c.sealed(
                    Kind::JournalBatch,
                    &batch_ctx(self.gen, self.next_seq, self.count),
                    &self.buf,
                )?;
                &sealed
            }
            None => &self.buf,
        };
        let Some(after) = self.next_seq.checked_add(1) else {
            return Err(Error::corrupt(
                format!("journal {}", journal_name(self.gen)),
                "its batch sequence numbers are used up (the checkpoint root names the last one): run `condense repair`",
            ));
        };
        let batch = encode_batch(self.next_seq, self.count, payload);
        self.file
            .write_at(&batch, self.len)
            .map_err(|e| Error::io(format!("writing journal {}", journal_name(self.gen)), e))?;
        self.len += batch.len() as u64;
        self.next_seq = after;
        self.buf.clear();
        self.count = 0;
        self.marked = false;
        Ok(())
    }
}

/// One replay of a journal file: its bytes, where replay has got to, and what it found.
struct Replay<'a> {
    name: String,
    data: Vec<u8>,
    gen: u64,
    mode: ReplayMode,
    crypto: Option<&'a Crypto>,
    report: ReplayReport,
    /// Offset and sequence number of the next batch.
    pos: usize,
    seq: u64,
    /// Replay stopped at bytes that are no valid batch (not at the end of the file).
    unreadable: bool,
    /// A damaged stretch or a damaged acknowledged batch was passed (salvage mode only).
    after_damage: bool,
}

impl Replay<'_> {
    /// An intact header must name this pool and generation.
    fn check_header(&self, uuid: &[u8; 16]) -> Result<()> {
        let name = &self.name;
        let found_gen = decode_journal_header(&self.data, uuid)
            .map_err(|e| Error::corrupt(format!("journal {name}"), e.to_string()))?;
        if found_gen != self.gen {
            return Err(Error::corrupt(
                format!("journal {name}"),
                format!("header says generation {found_gen}"),
            ));
        }
        Ok(())
    }

    /// A damaged header: rebuild it (on disk too in a writable open), unless nothing valid
    /// follows it, which only salvage mode accepts.
    fn mend_header(&mut self, file: &dyn File, uuid: &[u8; 16]) -> Result<()> {
        let (name, gen, mode) = (&self.name, self.gen, self.mode);
        let data = &self.data;
        // Damaged: every field of the header is known (the generation from the root, the
        // pool UUID from the superblock), and each batch checks itself. But a header is
        // synced when the file is made, so no crash damages it: when nothing valid follows
        // it (a file cut short, a zeroed sector), the batches it held are lost, not torn,
        // and only repair may drop them (saying so).
        let nothing_after = data.len() > JOURNAL_HEADER_BYTES
            && !matches!(
                parse_batch(data, JOURNAL_HEADER_BYTES, self.seq, gen, self.crypto),
                Some(Ok(_))
            );
        if data.len() < JOURNAL_HEADER_BYTES || nothing_after {
            let what = if data.len() < JOURNAL_HEADER_BYTES {
                format!(
                    "journal truncated to {} bytes (its header alone is {JOURNAL_HEADER_BYTES})",
                    data.len()
                )
            } else {
                "its header is damaged and no valid batch follows it".to_string()
            };
            if mode != ReplayMode::Salvage {
                return Err(Error::corrupt(
                    format!("journal {name}"),
                    format!("{what}: the writes since the last checkpoint may be lost; stop every user of the pool, run `condense repair --dry-run`, then `condense repair` (it keeps a copy of the damaged files and opens the pool as of its last checkpoint)"),
                ));
            }
            self.report.notes.push(format!(
                "journal {name}: {what}: the writes it held since the last checkpoint are lost (their blocks keep older content); compare the volumes with a backup"
            ));
        }
        self.report.notes.push(format!(
            "the header of journal {name} was damaged; rebuilt from the checkpoint root and the superblock"
        ));
        if mode == ReplayMode::Writable {
            let header = encode_journal_header(gen, uuid);
            file.write_at(&header, 0)
                .and_then(|_| file.sync())
                .map_err(|e| Error::io(format!("rewriting the header of journal {name}"), e))?;
            if self.data.len() < header.len() {
                self.data = header;
            } else {
                self.data[..header.len()].copy_from_slice(&header);
            }
        }
        Ok(())
    }

    /// Hand each valid batch to `apply`, in order, until the journal ends.
    fn apply_batches(
        &mut self,
        apply: &mut impl FnMut(Vec<JournalRecord>, bool) -> Result<bool>,
    ) -> Result<()> {
        loop {
            let (name, pos, seq) = (&self.name, self.pos, self.seq);
            let parsed = match parse_batch(&self.data, pos, seq, self.gen, self.crypto) {
                // Repair keeps what it can read: an unreadable batch is damage to skip.
                Some(Err(Error::Corrupt { .. })) if self.mode == ReplayMode::Salvage => None,
                p => p,
            };
            let Some(parsed) = parsed else {
                if self.skip_damage() {
                    continue;
                }
                break;
            };
            let (records, next) = parsed.map_err(|e| match e {
                Error::Auth { detail, .. } => Error::Auth {
                    what: format!("journal {name} batch {seq} at offset {pos}"),
                    detail,
                },
                e => e,
            })?;
            // A batch is a header and its payload, inside the file.
            debug_assert!(pos < next && next <= self.data.len());
            let n = records.len() as u64;
            if !apply(records, self.after_damage)? && !self.apply_refused(apply)? {
                break;
            }
            self.report.batches += 1;
            self.report.records += n;
            self.pos = next;
            // The last sequence number there is (only a crafted root or batch gets there):
            // the journal ends.
            let Some(after) = self.seq.checked_add(1) else {
                break;
            };
            self.seq = after;
        }
        Ok(())
    }

    /// No valid batch at `pos`: in salvage mode, record the damaged bytes up to the next valid
    /// batch and go on from there (true); otherwise the journal ends here (false).
    fn skip_damage(&mut self) -> bool {
        let (pos, seq, gen, crypto) = (self.pos, self.seq, self.gen, self.crypto);
        let data = &self.data;
        self.unreadable = pos < data.len();
        let later = if self.mode == ReplayMode::Salvage && self.unreadable {
            find_later_batch(data, pos + 1, seq, gen, crypto)
        } else {
            None
        };
        let Some(at) = later else { return false };
        let next_seq = decode_batch_header(&data[at..]).map_or(seq.saturating_add(1), |h| h.seq);
        // find_later_batch only finds batches after this one, numbered after it.
        debug_assert!(at > pos && next_seq > seq);
        let (records, decoded_whole) = decode_damaged(&data[pos..at], gen, crypto);
        self.report.damaged.push(DamagedStretch {
            file: self.name.clone(),
            offset: pos as u64,
            bytes: (at - pos) as u64,
            first_seq: seq,
            next_seq,
            records,
            decoded_whole,
        });
        self.after_damage = true;
        self.pos = at;
        self.seq = next_seq;
        true
    }

    /// `apply` refused the batch at `pos` (its chunk records are not whole): whether replay
    /// goes on past it. Never acknowledged, the journal ends here (a crash lost its data);
    /// acknowledged, it is damage: an error, or in salvage mode applied as after damage.
    fn apply_refused(
        &mut self,
        apply: &mut impl FnMut(Vec<JournalRecord>, bool) -> Result<bool>,
    ) -> Result<bool> {
        let (name, pos, seq, gen, crypto) = (&self.name, self.pos, self.seq, self.gen, self.crypto);
        if !acknowledged(&self.data, pos, seq, gen, crypto) {
            // Refers to data a crash lost: never acknowledged, nor is anything after.
            return Ok(false);
        }
        // Acknowledged, yet its chunk records are not whole: damage, not a crash.
        if self.mode != ReplayMode::Salvage {
            return Err(Error::corrupt(
                format!("journal {name}"),
                format!("batch {seq} at offset {pos} names chunk records that are damaged or missing in the segments, although a later flush shows it was acknowledged, so this is damage, not a crash, and opening would drop acknowledged changes; stop every user of the pool, run `condense repair --dry-run` to see which blocks are lost, then `condense repair` to keep the rest"),
            ));
        }
        // Repair applies it as it applies batches after damage: each chunk is kept
        // only if its record is whole, else its blocks are reported lost.
        let Some(Ok((records, _))) = parse_batch(&self.data, pos, seq, gen, crypto) else {
            return Ok(false);
        };
        self.report.notes.push(format!(
            "journal batch {seq} was acknowledged but names damaged chunk records"
        ));
        apply(records, true)?;
        self.after_damage = true;
        Ok(true)
    }

    /// After unreadable bytes there must not be a later valid batch: that would be damage.
    fn check_nothing_after(&self) -> Result<()> {
        let (name, pos, seq) = (&self.name, self.pos, self.seq);
        if let Some(at) = self
            .unreadable
            .then(|| find_later_batch(&self.data, pos + 1, seq, self.gen, self.crypto))
            .flatten()
        {
            return Err(Error::corrupt(
                format!("journal {name}"),
                format!("batch {seq} at offset {pos} is damaged but a later batch follows at offset {at}, so this is damage, not a crash, and opening would drop acknowledged changes; stop every user of the pool, run `condense repair --dry-run` to see what would be lost, then `condense repair` to salvage the rest (it keeps a copy of the damaged files)"),
            ));
        }
        Ok(())
    }
}

/// The associated data of a sealed batch payload.
fn batch_ctx(gen: u64, seq: u64, count: u32) -> [u8; 20] {
    let mut c = [0u8; 20];
    c[..8].copy_from_slice(&gen.to_le_bytes());
    c[8..16].copy_from_slice(&seq.to_le_bytes());
    c[16..].copy_from_slice(&count.to_le_bytes());
    c
}

/// A parsed batch: its records and where the next batch starts.
type Parsed = (Vec<JournalRecord>, usize);

/// Parse the batch at `pos` if it is whole, valid and numbered `seq`: `None` if it is not a
/// batch (a torn tail), an error if its CRC holds but it does not authenticate or its records
/// do not decode. A torn write cannot make a CRC hold, so such a batch was written whole, by
/// a build that knows records this one does not (or it was damaged after its CRC was made):
/// taking it for the journal's end would drop it and every acknowledged write after it.
fn parse_batch(
    data: &[u8],
    pos: usize,
    seq: u64,
    gen: u64,
    crypto: Option<&Crypto>,
) -> Option<Result<Parsed>> {
    let header = data.get(pos..pos + BATCH_HEADER_BYTES)?;
    let h = decode_batch_header(header)?;
    let end = pos + BATCH_HEADER_BYTES + h.payload_len as usize;
    let payload = data.get(pos + BATCH_HEADER_BYTES..end)?;
    if h.seq != seq || !batch_valid(header, &h, payload) {
        return None;
    }
    let opened;
    let payload = match crypto {
        Some(c) => {
            match c.open(
                Kind::JournalBatch,
                &batch_ctx(gen, seq, h.count),
                payload,
                || format!("journal batch {seq} at offset {pos}"),
            ) {
                Ok(p) => opened = p,
                Err(e) => return Some(Err(e)),
            }
            &opened[..]
        }
        None => payload,
    };
    let mut r = Reader::new(payload, "journal batch");
    // The count is read from the file: every record takes at least one byte of the payload.
    let mut records = Vec::with_capacity((h.count as usize).min(payload.len()));
    let undecodable = |why: String| {
        Some(Err(Error::corrupt(
            format!("journal batch {seq} at offset {pos}"),
            format!("its checksum holds but {why}: it was written by a newer build of condense (open the pool with that build) or damaged; nothing was changed. If no newer build wrote it, stop every user of the pool and run `condense repair --dry-run`, then `condense repair`"),
        )))
    };
    for i in 0..h.count {
        match JournalRecord::decode(&mut r) {
            Ok(rec) => records.push(rec),
            Err(e) => {
                return undecodable(format!("record {i} of {} cannot be read ({e})", h.count))
            }
        }
    }
    if r.remaining() != 0 {
        return undecodable(format!(
            "{} bytes follow its {} records",
            r.remaining(),
            h.count
        ));
    }
    Some(Ok((records, end)))
}

/// Best-effort decode of damaged journal bytes: batch headers and records are read without
/// checking the batch checksum; a batch whose records do not decode is skipped (by the length
/// its header gives) and the rest still read. In an encrypted pool a batch's records are
/// readable only if its payload still authenticates (damage elsewhere, e.g. in its header).
/// Returns the records and whether every byte was accounted for (`false`: some batches'
/// records are unknown).
fn decode_damaged(data: &[u8], gen: u64, crypto: Option<&Crypto>) -> (Vec<JournalRecord>, bool) {
    let mut out = Vec::new();
    let mut complete = true;
    let mut pos = 0;
    while pos < data.len() {
        let Some(h) = data.get(pos..).and_then(decode_batch_header) else {
            return (out, false);
        };
        let start = pos + BATCH_HEADER_BYTES;
        let end = start.saturating_add(h.payload_len as usize).min(data.len());
        pos = end;
        let Some(payload) = data.get(start..end) else {
            return (out, false);
        };
        let opened;
        let payload = match crypto {
            Some(c) => {
                match c.open(
                    Kind::JournalBatch,
                    &batch_ctx(gen, h.seq, h.count),
                    payload,
                    String::new,
                ) {
                    Ok(p) => opened = p,
                    Err(_) => {
                        complete = false;
                        continue;
                    }
                }
                &opened[..]
            }
            None => payload,
        };
        let mut r = Reader::new(payload, "damaged journal batch");
        for _ in 0..h.count {
            match JournalRecord::decode(&mut r) {
                Ok(rec) => out.push(rec),
                Err(_) => {
                    complete = false;
                    break;
                }
            }
        }
    }
    (out, complete)
}

/// Whether batch `seq` at `pos` was acknowledged: the valid batches from it on hold the flush
/// mark at least twice (the first marked flush then completed, and it synced batch `seq`).
fn acknowledged(
    data: &[u8],
    mut pos: usize,
    mut seq: u64,
    gen: u64,
    crypto: Option<&Crypto>,
) -> bool {
    let mut marks = 0;
    while let Some(Ok((records, next))) = parse_batch(data, pos, seq, gen, crypto) {
        if records.last().is_some_and(JournalRecord::is_flush_mark) {
            marks += 1;
            if marks == 2 {
                return true;
            }
        }
        pos = next;
        let Some(after) = seq.checked_add(1) else {
            return false;
        };
        seq = after;
    }
    false
}

/// The offset of a whole, valid batch numbered after `seq`, searching from `from`.
fn find_later_batch(
    data: &[u8],
    from: usize,
    seq: u64,
    gen: u64,
    crypto: Option<&Crypto>,
) -> Option<usize> {
    let magic = condense_format::BATCH_MAGIC.to_le_bytes();
    (from..data.len().saturating_sub(BATCH_HEADER_BYTES)).find(|&p| {
        data[p..p + 4] == magic
            && decode_batch_header(&data[p..])
                .is_some_and(|h| h.seq > seq && parse_batch(data, p, h.seq, gen, crypto).is_some())
    })
}

/// What replaying the journal in salvage mode set aside for `condense repair`'s rebuild
/// (filled by the salvage replay's hook, condense-engine `pool/salvage.rs`, read by the rebuild).
#[derive(Clone, Debug, Default)]
pub struct Salvage {
    /// Where batches put chunks (new or relocated): id → location and fingerprint if given.
    pub chunks: std::collections::HashMap<
        u64,
        (
            condense_format::Location,
            Option<condense_format::Fingerprint>,
        ),
    >,
    /// Blocks written by batches after the first damage: volume → (first, end) ranges.
    pub written_after: std::collections::BTreeMap<u32, Vec<(u64, u64)>>,
    /// Changes that could not be applied, in words.
    pub skipped: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found writing the journal fuzz target: a batch's record count was read from its header
    /// and reserved before decoding, so a batch of a few bytes with a count of 2^32 - 1 (and a
    /// CRC, which anyone can compute) reserved hundreds of GiB and aborted the process.
    #[test]
    fn a_batch_count_cannot_make_replay_allocate() {
        let mut payload = Vec::new();
        JournalRecord::DropChunk { id: 3 }.encode(&mut payload);
        let mut data = vec![0u8; JOURNAL_HEADER_BYTES];
        data.extend_from_slice(&encode_batch(7, u32::MAX, &payload));
        // One record where the header promises 2^32 - 1: an error (its CRC holds), and
        // nothing reserved for the count.
        assert!(matches!(
            parse_batch(&data, JOURNAL_HEADER_BYTES, 7, 1, None),
            Some(Err(Error::Corrupt { .. }))
        ));
        let mut data = vec![0u8; JOURNAL_HEADER_BYTES];
        data.extend_from_slice(&encode_batch(7, 1, &payload));
        assert!(matches!(
            parse_batch(&data, JOURNAL_HEADER_BYTES, 7, 1, None),
            Some(Ok((r, _))) if r == vec![JournalRecord::DropChunk { id: 3 }]
        ));
    }

    /// A whole batch (its CRC holds) with a record of a tag this build does not know, as a
    /// newer build would write: an error naming the batch, not the journal's end (which
    /// would drop it and every acknowledged write after it).
    #[test]
    fn a_whole_batch_with_an_unknown_record_is_an_error_not_the_end() {
        let mut payload = Vec::new();
        JournalRecord::DropChunk { id: 3 }.encode(&mut payload);
        payload.extend_from_slice(&[0xEE, 1, 2, 3]);
        let mut data = vec![0u8; JOURNAL_HEADER_BYTES];
        data.extend_from_slice(&encode_batch(7, 2, &payload));
        match parse_batch(&data, JOURNAL_HEADER_BYTES, 7, 1, None) {
            Some(Err(e)) => {
                let text = e.to_string();
                assert!(
                    text.contains("batch 7") && text.contains("newer build"),
                    "{text}"
                );
            }
            other => panic!("expected an error, got {other:?}"),
        }
        // The same bytes torn (one byte short of the payload): the journal's end.
        let torn = &data[..data.len() - 1];
        assert!(parse_batch(torn, JOURNAL_HEADER_BYTES, 7, 1, None).is_none());
    }

    /// Found by the journal fuzz target: a root naming the last sequence number and a valid
    /// batch with it overflowed the next number (a panic); the journal now ends there, and
    /// sealing past it is an error.
    #[test]
    fn the_last_sequence_number_ends_the_journal() -> Result<()> {
        let dir = condense_store::sim::SimHandle(condense_store::sim::SimDir::new());
        let uuid = [5u8; 16];
        let mut j = Journal::create(&dir, 1, &uuid, u64::MAX, None)?;
        j.append(&JournalRecord::DropChunk { id: 3 });
        let mut payload = Vec::new();
        JournalRecord::DropChunk { id: 3 }.encode(&mut payload);
        j.file
            .write_at(
                &encode_batch(u64::MAX, 1, &payload),
                JOURNAL_HEADER_BYTES as u64,
            )
            .map_err(|e| Error::io("write", e))?;
        assert!(j.seal().is_err(), "no number is left for the batch");
        for mode in [
            ReplayMode::ReadOnly,
            ReplayMode::Writable,
            ReplayMode::Salvage,
        ] {
            let mut applied = 0;
            let (_, report) = Journal::replay(&dir, 1, &uuid, u64::MAX, mode, None, |_, _| {
                applied += 1;
                Ok(true)
            })?;
            assert_eq!((applied, report.batches), (1, 1), "{mode:?}");
        }
        Ok(())
    }
}

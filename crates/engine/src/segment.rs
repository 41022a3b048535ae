//! The segment store: append-only files of chunk records.
//!
//! Owns: which segment files exist, their lengths, and the one open segment new records go to.
//! Invariants:
//! - Only the open segment is ever written; every other segment is sealed and immutable
//!   (DESIGN.md invariant 4). Each pool open starts a new open segment, so a torn tail left by
//!   a crash is never appended to.
//! - Records are staged in `pending` and written with one `write_at` per batch
//!   ([`Segments::write_pending`]); a location is handed out only for bytes that will be
//!   written before the state lock is released.
//! - A segment is reported dirty until the next flush syncs it.

use crate::error::{Error, Result};
use crate::format::{
    encode_record, encode_segment_header, segment_name, ChunkCodec, Fingerprint, Location,
    SEGMENT_HEADER_BYTES,
};
use crate::io::{Dir, File};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

pub struct SegmentFile {
    pub file: Arc<dyn File>,
    /// Bytes in the file (including any torn tail found at open).
    pub len: u64,
}

pub struct Segments {
    files: BTreeMap<u32, SegmentFile>,
    open: Option<u32>,
    next_id: u32,
    pending: Vec<u8>,
    /// Offset in the open segment where `pending` starts.
    pending_at: u64,
    dirty: BTreeSet<u32>,
    names_changed: bool,
    target_bytes: u64,
    uuid: [u8; 16],
}

impl Segments {
    pub fn new(target_bytes: u64, uuid: [u8; 16]) -> Segments {
        Segments {
            files: BTreeMap::new(),
            open: None,
            next_id: 0,
            pending: Vec::new(),
            pending_at: 0,
            dirty: BTreeSet::new(),
            names_changed: false,
            target_bytes,
            uuid,
        }
    }

    /// Register an existing segment found in the pool directory.
    pub fn add_existing(&mut self, id: u32, file: Arc<dyn File>, len: u64) {
        self.files.insert(id, SegmentFile { file, len });
        self.next_id = self.next_id.max(id + 1);
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
        let offset = self.pending_at + self.pending.len() as u64;
        encode_record(&mut self.pending, id, fp, codec, payload);
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
        let offset = self.pending_at + self.pending.len() as u64;
        self.pending.extend_from_slice(record);
        Ok(Location {
            segment: seg,
            offset: offset as u32,
            ..*old
        })
    }

    fn room_for(&mut self, dir: &dyn Dir, record: u64) -> Result<u32> {
        if let Some(open) = self.open {
            let end = self.pending_at + self.pending.len() as u64;
            if end + record <= self.target_bytes || end == SEGMENT_HEADER_BYTES as u64 {
                return Ok(open);
            }
            self.write_pending()?;
        }
        self.start_segment(dir)
    }

    fn start_segment(&mut self, dir: &dyn Dir) -> Result<u32> {
        let id = self.next_id;
        let name = segment_name(id);
        let file = dir
            .open(&name, true)
            .map_err(|e| Error::io(format!("creating segment {name}"), e))?;
        let header = encode_segment_header(id, &self.uuid);
        file.write_at(&header, 0)
            .map_err(|e| Error::io(format!("writing segment {name}"), e))?;
        self.next_id += 1;
        self.files.insert(
            id,
            SegmentFile {
                file,
                len: header.len() as u64,
            },
        );
        self.open = Some(id);
        self.pending_at = header.len() as u64;
        self.dirty.insert(id);
        self.names_changed = true;
        Ok(id)
    }

    /// Write staged records to the open segment (one call). On failure nothing staged is
    /// kept and the locations handed out since the last write must not be used.
    pub fn write_pending(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let Some(open) = self.open else {
            return Err(Error::Invalid(
                "records staged without an open segment".into(),
            ));
        };
        let seg = self
            .files
            .get_mut(&open)
            .ok_or_else(|| Error::Invalid(format!("open segment {open} missing")))?;
        let r = seg.file.write_at(&self.pending, self.pending_at);
        match r {
            Ok(()) => {
                self.pending_at += self.pending.len() as u64;
                seg.len = self.pending_at;
                self.pending.clear();
                self.dirty.insert(open);
                Ok(())
            }
            Err(e) => {
                self.pending.clear();
                Err(Error::io(
                    format!("writing segment {}", segment_name(open)),
                    e,
                ))
            }
        }
    }

    /// Forget staged records (after a failed batch).
    pub fn discard_pending(&mut self) {
        self.pending.clear();
    }

    /// Segment files written since the last call, and whether names were created since.
    pub fn take_dirty(&mut self) -> (Vec<Arc<dyn File>>, bool) {
        let files = std::mem::take(&mut self.dirty)
            .into_iter()
            .filter_map(|id| self.file(id))
            .collect();
        (files, std::mem::take(&mut self.names_changed))
    }

    /// Forget a deleted segment.
    pub fn forget(&mut self, id: u32) {
        self.files.remove(&id);
        self.dirty.remove(&id);
    }

    pub fn len_of(&self, id: u32) -> u64 {
        self.files.get(&id).map_or(0, |s| s.len)
    }
}

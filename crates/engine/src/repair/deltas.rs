//! The rebuild's deltas (docs/FORMAT.md "Delta records", docs/REPAIR.md "Delta compression").
//!
//! Owns: keeping a delta a map names together with its bases. Invariants: a delta enters the
//! new chunk table only once every base its record names is there (a chunk that is not a
//! delta, or a forward to one), applied as `NewDelta`, so each base holds one reference per
//! delta naming it (a base only deltas name stays live); a base is found as any chunk is (the
//! batches, the old chunk table, the segment scan); a delta with a base lost or damaged is
//! lost with it, so every block of the delta is named. A base id the old table forwards is a
//! forward again in the new table (the delta's record names that id).

use super::{open_record, record_id, scan_segments, Rebuild};
use crate::error::Result;
use crate::format::reduction::DeltaPayload;
use crate::format::{Fingerprint, JournalRecord, Location};
use std::collections::HashMap;

/// Records the segment scan found: id → location and fingerprint.
type Found = HashMap<u64, (Location, Fingerprint)>;

/// What becomes of a delta (or of one of its bases).
pub(super) enum Fate {
    /// In the new table (with its bases).
    Kept,
    /// A base is not located yet: decided after the segment scan.
    Wait,
    /// Given up, and why (its blocks are lost).
    Lost(String),
}

impl Rebuild<'_> {
    /// The bases delta `id`'s record at `loc` names (the record read, checked and opened).
    pub(super) fn bases_of(&self, id: u64, loc: &Location, fp: &Fingerprint) -> Result<Vec<u64>> {
        let what = || format!("chunk {id} in segment {}", loc.segment);
        let file = self.segments.file(loc.segment);
        let file = file.ok_or_else(|| crate::error::Error::corrupt(what(), "segment missing"))?;
        let mut buf = vec![0u8; loc.record_bytes() as usize];
        file.read_at(&mut buf, u64::from(loc.offset))
            .map_err(|e| crate::error::Error::io(what(), e))?;
        let rid = record_id(id, loc, self.slot);
        let payload = open_record(&buf, rid, loc, self.crypto, Some(fp), what)?;
        Ok(DeltaPayload::parse(&payload, what)?.bases)
    }

    /// Keep delta `id` (its record at `loc`) with its bases, if each is found; `found`: what
    /// the segment scan found, `None` before it (a base not located then makes the delta wait).
    pub(super) fn keep_delta(
        &mut self,
        id: u64,
        loc: Location,
        fp: Fingerprint,
        found: Option<&Found>,
    ) -> Result<Fate> {
        if self.inserted.contains(id) {
            return Ok(Fate::Kept);
        } else if let Some(why) = self.lost_deltas.get(&id) {
            return Ok(Fate::Lost(why.clone()));
        } else if found.is_none() && self.waiting.contains_key(&id) {
            return Ok(Fate::Wait);
        }
        let (bases, mut adds) = (self.bases_of(id, &loc, &fp), Vec::new());
        let mut why = bases
            .as_ref()
            .err()
            .map(|e| format!("record cannot be read ({e})"));
        for &b in bases.as_deref().unwrap_or_default() {
            match self.base(b, found)? {
                Ok(Some(add)) => adds.push(add),
                Ok(None) => {}
                Err(Fate::Lost(w)) => why = why.or(Some(format!("base chunk {b} {w}"))),
                Err(_) => {
                    self.waiting.insert(id, (loc, fp));
                    return Ok(Fate::Wait);
                }
            }
        }
        if let Some(why) = why {
            let why = format!("its chunk {id} is a delta whose {why}");
            self.lost_deltas.insert(id, why.clone());
            return Ok(Fate::Lost(why));
        }
        // Each base in, then the delta (a reference on each), then the forwards, which take
        // over the references the delta just took.
        let mut forwards = Vec::new();
        for (b, (rid, loc, fp), scanned) in adds {
            for c in [rid, b] {
                if self.inserted.contains(c) {
                    continue;
                }
                self.new
                    .apply(&JournalRecord::NewChunk { id: c, loc, fp })?;
                self.inserted.add(c);
                self.report.chunks_from_segments += u64::from(scanned);
                if c != rid {
                    forwards.push(JournalRecord::Forward { id: c, to: rid });
                }
            }
        }
        let bases = bases?;
        self.new
            .apply(&JournalRecord::NewDelta { id, loc, fp, bases })?;
        self.inserted.add(id);
        forwards.iter().try_for_each(|f| self.new.apply(f))?;
        Ok(Fate::Kept)
    }

    /// Base `b` of a delta: `None` if the new table has it, else where its record is (the id
    /// whose record it reads, location, fingerprint) and whether the scan found it; or why it
    /// is lost, or that it waits for the scan.
    #[allow(clippy::type_complexity)]
    fn base(
        &mut self,
        b: u64,
        found: Option<&Found>,
    ) -> Result<std::result::Result<Option<(u64, (u64, Location, Fingerprint), bool)>, Fate>> {
        let delta = || Err(Fate::Lost("is itself a delta".into()));
        if self.inserted.contains(b) {
            return Ok(match self.new.chunks.resolve(&mut self.new.pages, b)? {
                Some((_, e)) if e.loc.codec.is_delta() => delta(),
                _ => Ok(None),
            });
        }
        let (at, scanned) = match (self.locate_checked(b), found) {
            (Ok(at), _) => (at, false),
            (Err((why, fp)), None) => {
                self.why.entry(b).or_insert(why);
                fp.map(|fp| self.expect.insert(b, fp));
                return Ok(Err(Fate::Wait));
            }
            (Err((why, _)), Some(found)) => match found.get(&b) {
                Some(&(loc, fp)) => ((b, loc, fp), true),
                None => {
                    return Ok(Err(Fate::Lost(format!(
                        "{why} and no valid copy is in the segments"
                    ))))
                }
            },
        };
        Ok(if at.1.codec.is_delta() {
            delta()
        } else {
            Ok(Some((b, at, scanned)))
        })
    }

    /// Look for the bases only deltas the segment scan found name, which cannot be located
    /// otherwise and were not looked for: a second scan, added to `found`.
    pub(super) fn scan_for_bases(&mut self, found: &mut Found) {
        let mut more = HashMap::new();
        for (id, (loc, fp)) in found
            .clone()
            .into_iter()
            .filter(|f| f.1 .0.codec.is_delta())
        {
            for b in self.bases_of(id, &loc, &fp).unwrap_or_default() {
                if self.inserted.contains(b) || found.contains_key(&b) || self.why.contains_key(&b)
                {
                    continue;
                }
                if let Err((why, fp)) = self.locate_checked(b) {
                    more.insert(b, why);
                    fp.map(|fp| self.expect.insert(b, fp));
                }
            }
        }
        if !more.is_empty() {
            found.extend(scan_segments(self.segments, &more, &self.expect));
        }
    }
}

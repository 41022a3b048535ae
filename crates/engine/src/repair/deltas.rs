//! The rebuild's deltas (docs/FORMAT.md "Delta records", docs/REPAIR.md "Delta compression").
//!
//! Owns: keeping a delta a map names together with its bases. Invariants: a delta enters the
//! new chunk table only once every base it names is there (a chunk that is not a delta, or a
//! forward to one), and is applied as `NewDelta`, so each base holds one reference per delta
//! naming it (a base only deltas name stays live); a base is found as any chunk is (the
//! batches, the old chunk table, the segment scan); a delta with a base lost or damaged is
//! lost with it, so every block of the delta is named. A base id the old table forwards
//! becomes a forward again in the new table (the delta's record names that id).

use super::{open_record, record_id, scan_segments, Rebuild};
use crate::error::Result;
use crate::format::reduction::DeltaPayload;
use crate::format::{Fingerprint, JournalRecord, Location};
use std::collections::HashMap;

/// Records the segment scan found: id → location and fingerprint.
type Found = HashMap<u64, (Location, Fingerprint)>;

/// What becomes of a delta.
pub(super) enum Fate {
    /// In the new table with its bases.
    Kept,
    /// A base is not located yet: decided after the segment scan.
    Wait,
    /// Given up, and why (its blocks are lost).
    Lost(String),
}

/// What a delta's base needs.
enum Step {
    /// Nothing: it is in the new table.
    Have,
    /// Into the new table: chunk `rid`'s record at `loc`, the delta's id for it `id` (a
    /// forward to `rid` when they differ), found by the scan or not.
    Add {
        id: u64,
        rid: u64,
        loc: Location,
        fp: Fingerprint,
        scanned: bool,
    },
    Wait,
    Lost(String),
}

impl Rebuild<'_> {
    /// The bases delta `id`'s record at `loc` names (the record read, checked and opened).
    pub(super) fn bases_of(
        &self,
        id: u64,
        loc: &Location,
        fp: &Fingerprint,
    ) -> std::result::Result<Vec<u64>, String> {
        let file = self
            .segments
            .file(loc.segment)
            .ok_or_else(|| format!("segment {} is missing", loc.segment))?;
        let mut buf = vec![0u8; loc.record_bytes() as usize];
        file.read_at(&mut buf, u64::from(loc.offset))
            .map_err(|e| e.to_string())?;
        let what = || {
            format!(
                "chunk {id} in segment {} at offset {}",
                loc.segment, loc.offset
            )
        };
        let rid = record_id(id, loc, self.slot);
        let payload =
            open_record(&buf, rid, loc, self.crypto, Some(fp), what).map_err(|e| e.to_string())?;
        let bases = DeltaPayload::parse(&payload, what).map_err(|e| e.to_string())?;
        Ok(bases.bases)
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
        }
        if let Some(why) = self.lost_deltas.get(&id) {
            return Ok(Fate::Lost(why.clone()));
        }
        if found.is_none() && self.waiting.contains_key(&id) {
            return Ok(Fate::Wait);
        }
        let lost = |why: String| format!("its chunk {id} is a delta whose {why}");
        let bases = match self.bases_of(id, &loc, &fp) {
            Ok(b) => b,
            Err(e) => return Ok(self.give_up(id, lost(format!("record cannot be read ({e})")))),
        };
        let mut steps = Vec::with_capacity(bases.len());
        for &b in &bases {
            match self.base(b, found)? {
                Step::Wait => {
                    self.waiting.insert(id, (loc, fp));
                    return Ok(Fate::Wait);
                }
                Step::Lost(why) => {
                    return Ok(self.give_up(id, lost(format!("base chunk {b} {why}"))))
                }
                s => steps.push(s),
            }
        }
        let mut forwards = Vec::new();
        for s in steps {
            let Step::Add {
                id: b,
                rid,
                loc,
                fp,
                scanned,
            } = s
            else {
                continue;
            };
            for c in [rid, b] {
                if !self.inserted.contains(c) {
                    self.new
                        .apply(&JournalRecord::NewChunk { id: c, loc, fp })?;
                    self.inserted.add(c);
                    self.report.chunks_from_segments += u64::from(scanned && c == rid);
                    if c != rid {
                        forwards.push(JournalRecord::Forward { id: c, to: rid });
                    }
                }
            }
        }
        self.new
            .apply(&JournalRecord::NewDelta { id, loc, fp, bases })?;
        self.inserted.add(id);
        // A forward needs the references it takes over (the delta's, just taken).
        for f in forwards {
            self.new.apply(&f)?;
        }
        Ok(Fate::Kept)
    }

    /// Delta `id` is lost: `why`, remembered for its other blocks.
    fn give_up(&mut self, id: u64, why: String) -> Fate {
        self.lost_deltas.insert(id, why.clone());
        Fate::Lost(why)
    }

    /// What base `b` of a delta needs (see [`Rebuild::keep_delta`]).
    fn base(&mut self, b: u64, found: Option<&Found>) -> Result<Step> {
        if self.inserted.contains(b) {
            return Ok(match self.new.chunks.resolve(&mut self.new.pages, b)? {
                Some((_, e)) if e.loc.codec.is_delta() => Step::Lost("is itself a delta".into()),
                Some(_) => Step::Have,
                None => Step::Lost("is not in the rebuilt chunk table".into()),
            });
        }
        Ok(match (self.locate_checked(b), found) {
            (Ok((_, loc, _)), _) if loc.codec.is_delta() => Step::Lost("is itself a delta".into()),
            (Ok((rid, loc, fp)), _) => Step::Add {
                id: b,
                rid,
                loc,
                fp,
                scanned: false,
            },
            (Err((why, fp)), None) => {
                self.why.entry(b).or_insert(why);
                if let Some(fp) = fp {
                    self.expect.insert(b, fp);
                }
                Step::Wait
            }
            (Err((why, _)), Some(found)) => match found.get(&b) {
                Some(&(loc, _)) if loc.codec.is_delta() => Step::Lost("is itself a delta".into()),
                Some(&(loc, fp)) => Step::Add {
                    id: b,
                    rid: b,
                    loc,
                    fp,
                    scanned: true,
                },
                None => Step::Lost(format!("{why} and no valid copy is in the segments")),
            },
        })
    }

    /// Look for the bases the segment scan did not look for (named only by deltas it found)
    /// and that cannot be located otherwise: a second scan, added to `found`.
    pub(super) fn scan_for_bases(&mut self, found: &mut Found) {
        let deltas: Vec<(u64, Location, Fingerprint)> = found
            .iter()
            .filter(|(_, (loc, _))| loc.codec.is_delta())
            .map(|(&id, &(loc, fp))| (id, loc, fp))
            .collect();
        let mut more = HashMap::new();
        for (id, loc, fp) in deltas {
            for b in self.bases_of(id, &loc, &fp).unwrap_or_default() {
                if self.inserted.contains(b) || found.contains_key(&b) || self.why.contains_key(&b)
                {
                    continue;
                }
                if let Err((why, fp)) = self.locate_checked(b) {
                    more.insert(b, why);
                    if let Some(fp) = fp {
                        self.expect.insert(b, fp);
                    }
                }
            }
        }
        if !more.is_empty() {
            for (b, at) in scan_segments(self.segments, &more, &self.expect) {
                found.entry(b).or_insert(at);
            }
        }
    }
}

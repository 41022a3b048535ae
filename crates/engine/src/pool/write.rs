//! The write path: whole blocks hashed, deduplicated and compressed outside the state lock,
//! then stored and journaled under it.

use crate::crypto::Kind;
use crate::error::{Error, Result};
use crate::format::*;
use crate::reduction::{self, Compressor};
use crate::volume_counters::Reduced;
use rayon::prelude::*;
use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::atomic::Ordering;

use super::{Pool, State, SPACE_CHECK_BYTES};

impl Pool {
    /// Write whole blocks starting at block `first`. Safe to call concurrently; callers doing a
    /// read-modify-write hold the volume's write lock around it.
    ///
    /// Steps: (1) zero detection and fingerprints, (2) which blocks are new chunks, (3) their
    /// compression (and sealing), all without the state lock; then under it (4) the new
    /// records staged in the open segment and (5) the changes applied and journaled.
    /// Returns the journal sequence to flush through and what became of the blocks.
    pub(crate) fn write_blocks(
        &self,
        vol: u32,
        name: &str,
        first: u64,
        data: &[u8],
    ) -> Result<(u64, Reduced)> {
        let bs = self.sb.block_size as usize;
        debug_assert_eq!(data.len() % bs, 0);
        // Hash and compress on every core only while this is the only write in flight (and
        // the pool is not behind the NBD server: `set_spread_writes`): with more (an NBD
        // client's queue, FUSE's threads) each write on its own thread keeps both cores busy
        // without the cost of handing blocks between threads.
        let in_flight = super::InFlight::enter(&self.writes_in_flight);
        let spread = in_flight.alone() && self.spread_writes.load(Ordering::Relaxed);
        let fps = self.fingerprints(data, spread);
        let Lookup {
            misses,
            found,
            ids_at_lookup,
        } = self.find_misses(&fps)?;
        let storer = Storer {
            data,
            bs,
            comp: self.sb.compression,
            crypto: self.crypto.as_deref(),
        };
        let compressed = storer.compress(&fps, &misses, spread)?;
        let alone = |i: usize| compressed[i].as_ref().map_or(bs, |(_, p)| p.len());
        let deltas = self.find_deltas(data, &misses, &alone, spread)?;
        drop(in_flight);

        let mut st = self.lock_state();
        self.writable(&st)?;
        st.md
            .writable_volume_for(vol, name, "write", first, (data.len() / bs) as u64)?;
        self.check_space(&mut st, data.len() as u64)?;
        let first_new_id = st.md.chunks.next_id;
        let mark = st.segments.mark();
        // No chunk was added since step 2 (ids are taken and committed under one hold of the
        // lock): its misses are misses still, and are not looked up again.
        let misses_hold = ids_at_lookup == Some(first_new_id);
        let (mut records, entries, reduced) = match self.stage_new_chunks(
            &mut st,
            &storer,
            (&fps, &found),
            &compressed,
            &deltas,
            misses_hold,
        ) {
            Ok(staged) => staged,
            Err(e) => {
                Self::unwind(&mut st, first_new_id, mark);
                return Err(e);
            }
        };
        debug_assert_eq!(entries.len(), fps.len(), "one map entry per block written");
        // 5. Apply and journal the changes. The new records are readable from memory until
        // a batch's worth is staged and handed to be written (by the segment writer, in the
        // background, where the directory offers direct I/O); a flush writes them all.
        records.push(JournalRecord::MapRun {
            vol,
            start: first,
            entries,
        });
        let committed = self.commit(&mut st, records);
        if committed.is_err() {
            // Unless the state is half-changed (poisoned already), nothing was applied: the
            // journal buffer could not be written out, or a page could not be read.
            if st.poisoned.is_none() {
                Self::unwind(&mut st, first_new_id, mark);
            }
            return committed.map(|seq| (seq, reduced));
        }
        st.segments.write_full_batch()?;
        committed.map(|seq| (seq, reduced))
    }

    /// Write step 1: zero detection and fingerprints, `None` for an all-zero block (small
    /// blocks hashed 16 at a time; spread over every core for a large write alone in flight).
    fn fingerprints(&self, data: &[u8], spread: bool) -> Vec<Option<Fingerprint>> {
        let bs = self.sb.block_size as usize;
        let key = self.sb.key;
        if spread && data.len() >= 32 * bs {
            let parts: Vec<Vec<Option<Fingerprint>>> = data
                .par_chunks(16 * bs)
                .map(|part| reduction::classify(&key, part, bs))
                .collect();
            parts.concat()
        } else {
            reduction::classify(&key, data, bs)
        }
    }

    /// Write step 2: the blocks whose chunk the pool lacks (the first of each fingerprint),
    /// the chunks the others were found as, and the next chunk id when they were looked up.
    /// A small write skips this and compresses its new chunks under the lock in step 4: one
    /// lock round trip instead of two (not in a delta pool: the delta search needs the
    /// misses before the lock).
    fn find_misses(&self, fps: &[Option<Fingerprint>]) -> Result<Lookup> {
        if fps.len() <= SMALL_WRITE_BLOCKS && !self.deltas_on.load(Ordering::Relaxed) {
            return Ok(Lookup {
                misses: Vec::new(),
                found: vec![None; fps.len()],
                ids_at_lookup: None,
            });
        }
        let mut st = self.lock_state();
        let ids_at_lookup = Some(st.md.chunks.next_id);
        self.writable(&st)?;
        let mut seen: HashMap<Fingerprint, (), FpHash> =
            HashMap::with_capacity_and_hasher(fps.len(), FpHash);
        let found = st.md.find_duplicates(fps);
        let mut misses = Vec::new();
        for (i, fp) in fps.iter().enumerate() {
            let Some(fp) = fp.as_ref() else { continue };
            if found[i].is_none() && seen.insert(*fp, ()).is_none() {
                misses.push(i);
            }
        }
        Ok(Lookup {
            misses,
            found,
            ids_at_lookup,
        })
    }

    /// Write step 4, under the state lock: each block's map entry; a duplicate names the
    /// chunk it found (in the pool or earlier in this write), a new chunk is given an id and
    /// its record is appended to the open segment. Returns the `NewChunk` records, the
    /// entries and what became of the blocks; on an error the caller unwinds what was staged.
    fn stage_new_chunks<'d>(
        &self,
        st: &mut State,
        storer: &Storer<'d>,
        (fps, found): (&[Option<Fingerprint>], &[Option<u64>]),
        compressed: &[Option<Stored<'d>>],
        deltas: &super::delta::Deltas,
        misses_hold: bool,
    ) -> Result<(Vec<JournalRecord>, Vec<u64>, Reduced)> {
        let mut records = Vec::new();
        let mut reduced = Reduced::default();
        let mut entries = Vec::with_capacity(fps.len());
        let mut batch_new: HashMap<Fingerprint, u64, FpHash> =
            HashMap::with_capacity_and_hasher(fps.len(), FpHash);
        let mut small = Compressor::default();
        // This write's new chunks stored alone: bases its deltas may name.
        let mut plain = std::collections::HashSet::new();
        for (i, fp) in fps.iter().enumerate() {
            // Also for known misses: the commit below inserts them.
            if let Some(Some(ahead)) = fps.get(i + PREFETCH_AHEAD) {
                st.md.prefetch_duplicate(ahead);
            }
            let Some(fp) = fp else {
                entries.push(ENTRY_ZERO);
                reduced.zero += 1;
                continue;
            };
            if let Some(&id) = batch_new.get(fp) {
                entries.push(id);
                reduced.dedup += 1;
                continue;
            }
            // Found in step 2 (by a look-back too, which a lookup now may not repeat):
            // still that chunk, unless it went or is full since.
            if let Some(id) = found[i].and_then(|id| st.md.confirm_found(id, fp)) {
                entries.push(id);
                reduced.dedup += 1;
                continue;
            }
            let known_miss = misses_hold && compressed[i].is_some();
            if !known_miss {
                if let Some(id) = st.md.find_duplicate(fp) {
                    entries.push(id);
                    reduced.dedup += 1;
                    continue;
                }
            }
            // A new chunk (compressed in step 3, or now if the index changed since step 2).
            let fresh;
            let (codec, payload) = match &compressed[i] {
                Some((c, p)) => (*c, &**p),
                None => {
                    fresh = storer.store(&mut small, i, Some(fp))?;
                    (fresh.0, &*fresh.1)
                }
            };
            let Some(id) = st.md.chunks.allocate_id() else {
                return Err(Error::NoSpace(
                    "allocating a chunk id (the pool holds 2^48 chunks)".into(),
                ));
            };
            batch_new.insert(*fp, id);
            entries.push(id);
            reduced.new += 1;
            let staged = match deltas.delta.get(&i) {
                Some(d) => self.stage_delta(st, (id, fp), d, (&entries, &plain), payload.len())?,
                None => None,
            };
            if let Some((record, stored)) = staged {
                records.push(record);
                reduced.stored_bytes += stored;
                continue;
            }
            let loc = st.segments.append(&*self.dir, id, fp, codec, payload)?;
            records.push(JournalRecord::NewChunk { id, loc, fp: *fp });
            plain.insert(id);
            reduced.stored_bytes += payload.len() as u64;
            if let (Some(k), Some(s)) = (deltas.keys.get(&i), st.sketch.as_mut()) {
                s.insert(k, id);
            }
        }
        Ok((records, entries, reduced))
    }

    /// Give back the ids and staged records of a write that failed before anything of it
    /// was applied. Records of it that a full segment sent to be written stay there,
    /// unreferenced (GC reclaims them).
    fn unwind(st: &mut State, first_id: u64, mark: (Option<u32>, u64)) {
        st.segments.discard_since(mark);
        st.md.chunks.unallocate_to(first_id);
    }

    fn check_space(&self, st: &mut State, bytes: u64) -> Result<()> {
        st.written_since_space_check += bytes;
        if st.written_since_space_check < SPACE_CHECK_BYTES {
            return Ok(());
        }
        let avail = self
            .dir
            .available_bytes()
            .map_err(|e| Error::io("checking free space", e))?;
        if avail < self.opts.reserve_bytes + self.opts.low_space_bytes {
            self.space_low
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
        if avail < self.opts.reserve_bytes + bytes {
            return Err(Error::NoSpace(format!(
                "writing {bytes} bytes: only {avail} bytes free on the pool's disk, {} kept for metadata",
                self.opts.reserve_bytes
            )));
        }
        st.written_since_space_check = 0;
        Ok(())
    }

    /// Set `count` blocks from `first` to ZERO or UNMAPPED. The caller holds the write lock.
    pub(crate) fn fill_blocks(
        &self,
        vol: u32,
        name: &str,
        first: u64,
        count: u64,
        entry: u64,
    ) -> Result<u64> {
        debug_assert!(entry == ENTRY_ZERO || entry == ENTRY_UNMAPPED);
        let mut st = self.lock_state();
        self.writable(&st)?;
        st.md.writable_volume_for(vol, name, "zero", first, count)?;
        self.commit(
            &mut st,
            vec![JournalRecord::MapFill {
                vol,
                start: first,
                count,
                entry,
            }],
        )
    }
}

/// Hashes a fingerprint by its first eight bytes: they are already uniformly random.
#[derive(Clone, Copy, Default)]
pub(crate) struct FpHash;

impl std::hash::BuildHasher for FpHash {
    type Hasher = FpHasher;
    fn build_hasher(&self) -> FpHasher {
        FpHasher(0)
    }
}

#[derive(Default)]
pub(crate) struct FpHasher(u64);

impl std::hash::Hasher for FpHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // A fingerprint arrives as one 16-byte write; fold anything else in too.
        for chunk in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.0 = self.0.rotate_left(5) ^ u64::from_le_bytes(b);
        }
    }
}

/// Write step 2's answer: the blocks whose chunk the pool lacks (the first of each
/// fingerprint), the chunk each other block was found as, and the next chunk id then.
struct Lookup {
    misses: Vec<usize>,
    found: Vec<Option<u64>>,
    ids_at_lookup: Option<u64>,
}

/// A new chunk as stored: its codec and payload (the block itself when stored raw).
type Stored<'a> = (ChunkCodec, Cow<'a, [u8]>);

/// Writes of at most this many blocks compress their new chunks under the state lock.
const SMALL_WRITE_BLOCKS: usize = 4;

/// How many blocks ahead a write's loops over fingerprints prefetch the dedup index.
const PREFETCH_AHEAD: usize = 8;

/// Write step 3: a write's new chunks, compressed (or the block itself) and then sealed in
/// an encrypted pool (bound to the fingerprint and codec).
struct Storer<'d> {
    data: &'d [u8],
    bs: usize,
    comp: Compression,
    crypto: Option<&'d crate::crypto::Crypto>,
}

impl<'d> Storer<'d> {
    /// Block `i` of the write as it is stored.
    fn store(&self, z: &mut Compressor, i: usize, fp: Option<&Fingerprint>) -> Result<Stored<'d>> {
        let block = &self.data[i * self.bs..(i + 1) * self.bs];
        let (codec, payload) = match z.try_compress(self.comp, block) {
            Some((codec, c)) => (codec, Cow::Owned(c)),
            None => (ChunkCodec::Raw, Cow::Borrowed(block)),
        };
        match (self.crypto, fp) {
            (Some(c), Some(fp)) => Ok((
                codec,
                Cow::Owned(c.sealed(Kind::Chunk, &chunk_ctx(fp, codec), &payload)?),
            )),
            _ => Ok((codec, payload)),
        }
    }

    /// The misses of step 2 as stored, by block index; in write order, a run of misses per
    /// compressor (it skips LZ4 in runs of noise), runs spread over the cores if `spread`.
    fn compress(
        &self,
        fps: &[Option<Fingerprint>],
        misses: &[usize],
        spread: bool,
    ) -> Result<Vec<Option<Stored<'d>>>> {
        let compress_run = |run: &[usize]| -> Result<Vec<(usize, Stored<'d>)>> {
            let mut z = Compressor::default();
            run.iter()
                .map(|&i| self.store(&mut z, i, fps[i].as_ref()).map(|c| (i, c)))
                .collect()
        };
        // Four runs per core: long enough to skip noise, enough to share the cores.
        let per = reduction::compressor_run(misses.len(), rayon::current_num_threads(), spread);
        let compressed_list: Vec<(usize, Stored<'d>)> = if per < misses.len() {
            let runs: Vec<Vec<(usize, Stored<'d>)>> = misses
                .par_chunks(per)
                .map(compress_run)
                .collect::<Result<_>>()?;
            runs.concat()
        } else {
            compress_run(misses)?
        };
        let mut compressed: Vec<Option<Stored<'d>>> = vec![None; fps.len()];
        for (i, c) in compressed_list {
            compressed[i] = Some(c);
        }
        Ok(compressed)
    }
}

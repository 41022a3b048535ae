//! The read path: block-map entries, then chunk records from the cache tier or segments.

use crate::error::{Error, Result};
use crate::format::*;
use crate::locks::lock;
use crate::reduction::{self};
use rayon::prelude::*;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::cache_tier::ChunkCache;

use super::{in_volume, with_context, Pool};

impl Pool {
    /// Read `out.len() / block_size` whole blocks from block `first`.
    ///
    /// Steps: (1) under the state lock, each block's map entry and its chunk's location
    /// (zeros written for zero, unmapped and lost-as-zeros blocks); then without it (2) the
    /// cache tier looked up, (3) the records it lacks read from their segments, adjacent ones
    /// with one call, and (4) every record checked and decoded into `out`. Returns the cache
    /// tier's hits and misses (zeros without a cache tier).
    pub(crate) fn read_blocks(
        &self,
        vol: u32,
        name: &str,
        first: u64,
        out: &mut [u8],
    ) -> Result<(u64, u64)> {
        let bs = self.sb.block_size as usize;
        // Read and decode on every core only while this is the only read in flight: with
        // more (an NBD client's queue, FUSE's threads) each read on its own thread keeps the
        // cores busy, and handing blocks to rayon's workers only cost CPU (at queue depth 4,
        // 6-11 % of the server's CPU per 1 MiB read; bench/README.md). A read alone still
        // gains from it.
        let in_flight = super::InFlight::enter(&self.reads_in_flight);
        let (wanted, in_memory) = self.locate_blocks(vol, name, first, out)?;
        // The cache tier first: a hit is the record exactly as the segment holds it. A miss
        // is read from its segment, or from memory while it is staged or being written.
        let cache = self.tier();
        let cached: Vec<Option<Vec<u8>>> = match &cache {
            Some(c) => wanted
                .iter()
                .map(|w| c.lookup(w.id, &w.fp, &w.loc))
                .collect(),
            None => vec![None; wanted.len()],
        };
        let cache_misses = cached.iter().filter(|c| c.is_none()).count();
        let missed: Vec<usize> = (0..wanted.len())
            .filter(|&k| cached[k].is_none() && in_memory[k].is_none())
            .collect();
        let groups = adjacent_groups(&wanted, &missed);
        if self.dir.reads_cost_requests() {
            self.hint_requests(
                vol,
                first,
                (out.len() / bs) as u64,
                &wanted,
                &missed,
                &groups,
            );
        }
        let parallel = wanted.len() >= 32 && in_flight.alone();
        let read_one =
            |g: &(usize, usize)| read_group(&wanted, &missed, *g, name, &self.read_buffers);
        let bufs: Result<Vec<(u64, Vec<u8>)>> = if parallel && groups.len() >= 4 {
            groups.par_iter().map(read_one).collect()
        } else {
            groups.iter().map(read_one).collect()
        };
        let sources = Sources {
            wanted: &wanted,
            missed: &missed,
            groups: &groups,
            cached: &cached,
            in_memory: &in_memory,
        };
        let result = bufs.and_then(|bufs| {
            let decoded = self.decode_blocks(
                &sources,
                &bufs,
                cache.as_deref(),
                (first, name),
                out,
                parallel,
            );
            self.read_buffers
                .give_back(bufs.into_iter().map(|(_, buf)| buf));
            decoded
        });
        let mut cache_use = (0, 0);
        if let Some(c) = &cache {
            let hits = (wanted.len() - cache_misses) as u64;
            c.count(hits, cache_misses as u64, bs as u64);
            cache_use = (hits, cache_misses as u64);
        }
        if let Err(e) = &result {
            if e.is_damage() {
                self.read_errors.fetch_add(1, Ordering::Relaxed);
                // The client only sees EIO: the log says what and where.
                tracing::error!("read failed: {e}");
            }
        }
        result.map(|()| cache_use)
    }

    /// On a store whose reads cost requests: hint every group of adjacent records at once
    /// (fetched side by side rather than one or two at a time by this read's threads), then
    /// the blocks ahead of a sequential reader.
    fn hint_requests(
        &self,
        vol: u32,
        first: u64,
        count: u64,
        wanted: &[Wanted],
        missed: &[usize],
        groups: &[(usize, usize)],
    ) {
        hint_groups(wanted, missed, groups);
        let bs32 = self.sb.block_size;
        if let Some((from, to)) = self.read_ahead.next_window(vol, first, count, bs32) {
            self.hint_blocks(vol, from, to);
        }
    }

    /// Read step 4: check and decode every block's record into `out` (`bufs`: the groups'
    /// bytes read from segments, in the order of `sources.groups`); a record read from its
    /// segment is offered to the cache tier. `at`: the first block and the volume's name.
    fn decode_blocks(
        &self,
        sources: &Sources<'_>,
        bufs: &[(u64, Vec<u8>)],
        cache: Option<&ChunkCache>,
        (first, name): (u64, &str),
        out: &mut [u8],
        parallel: bool,
    ) -> Result<()> {
        let bs = self.sb.block_size as usize;
        let Sources {
            wanted,
            missed,
            groups,
            cached,
            in_memory,
        } = *sources;
        // Where each block of `out` comes from: (group, or None for a record from the
        // cache tier or memory; wanted index), or None for zeros.
        let mut slot: Vec<Option<(Option<usize>, usize)>> = vec![None; out.len() / bs];
        for (g, &(s, e)) in groups.iter().enumerate() {
            for &k in &missed[s..e] {
                slot[wanted[k].index] = Some((Some(g), k));
            }
        }
        for (k, (c, m)) in cached.iter().zip(in_memory).enumerate() {
            if c.is_some() || m.is_some() {
                slot[wanted[k].index] = Some((None, k));
            }
        }
        let record_of = |g: Option<usize>, k: usize| -> Option<&[u8]> {
            match (g, &cached[k], &in_memory[k]) {
                (Some(g), _, _) => {
                    let (start, buf) = &bufs[g];
                    buf.get((u64::from(wanted[k].loc.offset) - start) as usize..)
                }
                (None, Some(c), _) | (None, None, Some(c)) => Some(c),
                (None, None, None) => None,
            }
        };
        // The bases of the read's deltas, fetched together before any is decoded. A record
        // that does not open is left to its decode to report.
        let mut bases = Vec::new();
        for &(g, k) in slot.iter().flatten() {
            let w = &wanted[k];
            if let (true, Some(r)) = (w.loc.codec.is_delta(), record_of(g, k)) {
                bases.extend(
                    self.delta_bases_of(w.id, (&w.loc, &w.fp), r)
                        .unwrap_or_default(),
                );
            }
        }
        let bases = (!bases.is_empty()).then(|| self.base_blocks(&bases));
        let decode = |(i, dst): (usize, &mut [u8])| -> Result<()> {
            let Some((g, k)) = slot[i] else { return Ok(()) };
            let w = &wanted[k];
            let record = record_of(g, k).ok_or_else(|| {
                let at = format!("volume {name:?} block {}", first + i as u64);
                Error::corrupt(at, "its record was not read (a bug)")
            })?;
            self.decode_block(w, record, dst, (first + i as u64, name), bases.as_ref())?;
            if let (Some(c), true) = (cache, cached[k].is_none()) {
                self.offer_to_cache(c, w, record);
            }
            Ok(())
        };
        if parallel {
            out.par_chunks_mut(bs).enumerate().try_for_each(decode)
        } else {
            out.chunks_mut(bs).enumerate().try_for_each(decode)
        }
    }

    /// Offer the cache tier a record read from its segment (`record` starts with it).
    pub(super) fn offer_to_cache(&self, c: &ChunkCache, w: &Wanted, record: &[u8]) {
        let Some(r) = record.get(..w.loc.record_bytes() as usize) else {
            return;
        };
        if segment_slot(w.loc.segment) == self.slot {
            c.offer(w.id, &w.fp, r);
        } else {
            // Another host's record carries its id: cached under ours, with ours, so it
            // still checks once the chunk moved into this host's segments (crate::hosts lets
            // go of condemned segments).
            let mut own = r.to_vec();
            reown_record(&mut own, w.id);
            c.offer(w.id, &w.fp, &own);
        }
    }

    /// Read step 1, under the state lock: the chunk behind each block of the read, with the
    /// record's bytes if it is still in memory (staged or being written: not in its file
    /// yet); blocks without a chunk are zeroed in `out` here. A lost block fails the read
    /// unless lost blocks read as zeros ([`Pool::set_lost_reads_zeros`]).
    fn locate_blocks(&self, vol: u32, name: &str, first: u64, out: &mut [u8]) -> Result<Located> {
        let bs = self.sb.block_size as usize;
        let n = out.len() / bs;
        let mut wanted = Vec::new();
        let mut in_memory = Vec::new();
        let mut st = self.lock_state();
        st.md.volume_for(vol, name, "read", first, n as u64)?;
        let mut entries = Vec::with_capacity(n);
        let looked_up = crate::block_map::get_range(
            &mut st.md.pages,
            u64::from(vol),
            first,
            n as u64,
            &mut entries,
        )
        .map_err(|err| in_volume(err, name, &format!("blocks {first}..{}", first + n as u64)));
        if let Err(err) = looked_up {
            self.read_errors.fetch_add(1, Ordering::Relaxed);
            return Err(err);
        }
        for (i, &e) in entries.iter().enumerate() {
            let block = first + i as u64;
            if e == ENTRY_LOST {
                if !self.lost_reads_zeros.load(Ordering::Relaxed) {
                    self.read_errors.fetch_add(1, Ordering::Relaxed);
                    return Err(Error::Lost {
                        volume: name.to_string(),
                        block,
                    });
                }
                self.lost_read_as_zeros.fetch_add(1, Ordering::Relaxed);
            }
            if e == ENTRY_ZERO || e == ENTRY_UNMAPPED || e == ENTRY_LOST {
                out[i * bs..(i + 1) * bs].fill(0);
                continue;
            }
            let md = &mut st.md;
            // A forward (docs/FORMAT.md "Forwards") reads the record of the chunk it names.
            let loc = md.chunks.resolve(&mut md.pages, e).and_then(|c| {
                c.map(|(id, c)| (id, c.loc, c.fp)).ok_or_else(|| {
                    Error::corrupt(
                        format!("volume {name:?} block {block}"),
                        format!("chunk {e} does not exist (damaged metadata)"),
                    )
                })
            });
            let (id, loc, fp) = match loc {
                Ok(l) => l,
                Err(err) => {
                    self.read_errors.fetch_add(1, Ordering::Relaxed);
                    return Err(with_context(err, &format!("volume {name:?} block {block}")));
                }
            };
            let file = st.segments.file(loc.segment).ok_or_else(|| {
                Error::corrupt(
                    format!("volume {name:?} block {block}"),
                    format!("segment {} of chunk {e} is missing", loc.segment),
                )
            })?;
            in_memory.push(st.segments.in_memory(&loc));
            wanted.push(Wanted {
                index: i,
                id,
                loc,
                file,
                fp,
            });
        }
        if let Err(e) = st.md.pages.evict_to_budget() {
            st.poisoned = Some(e.to_string());
            return Err(e);
        }
        debug_assert_eq!(wanted.len(), in_memory.len());
        Ok((wanted, in_memory))
    }

    /// Read step 4: one record checked (CRC, authentication in an encrypted pool, the
    /// fingerprint it must hold) and decompressed into `dst`.
    fn decode_block(
        &self,
        w: &Wanted,
        record: &[u8],
        dst: &mut [u8],
        (block, name): (u64, &str),
        bases: Option<&std::collections::HashMap<u64, Result<Vec<u8>>>>,
    ) -> Result<()> {
        let (id, loc) = (w.id, &w.loc);
        let what = || {
            format!(
                "volume {name:?} block {block} (chunk {id}, segment {}, offset {})",
                loc.segment, loc.offset
            )
        };
        let rid = record_id(id, loc, self.slot);
        let payload = open_record(record, rid, loc, self.crypto.as_deref(), Some(&w.fp), what)
            .map_err(|err| with_context(err, &what()))?;
        if loc.codec.is_delta() {
            return self.decode_delta(&payload, dst, bases, what);
        }
        reduction::decompress(loc.codec, &payload, dst, what)
    }

    /// The map entries of `count` blocks from `first`.
    pub(crate) fn map_entries(
        &self,
        vol: u32,
        name: &str,
        first: u64,
        count: u64,
    ) -> Result<Vec<(u64, u64)>> {
        let mut st = self.lock_state();
        st.md.volume_for(vol, name, "block_status", first, count)?;
        let r = crate::block_map::mapped(&mut st.md.pages, u64::from(vol), first, first + count)
            .map_err(|e| in_volume(e, name, &format!("blocks {first}..{}", first + count)));
        st.md.pages.evict_to_budget()?;
        r
    }
}

/// What read step 1 found: the blocks whose bytes are a chunk's record, and for each the
/// record itself while it is still in memory.
type Located = (Vec<Wanted>, Vec<Option<Vec<u8>>>);

/// Where the records of one read come from (read steps 1 to 3): the blocks wanted, those
/// read from segments (`missed`, as `groups` of adjacent records), and the records the cache
/// tier or memory held.
#[derive(Clone, Copy)]
struct Sources<'a> {
    wanted: &'a [Wanted],
    missed: &'a [usize],
    groups: &'a [(usize, usize)],
    cached: &'a [Option<Vec<u8>>],
    in_memory: &'a [Option<Vec<u8>>],
}

/// A block of a read (or a base of its deltas) whose bytes are a chunk's record.
pub(super) struct Wanted {
    /// The block's index in the read.
    pub index: usize,
    pub id: u64,
    pub loc: Location,
    pub file: Arc<dyn crate::io::File>,
    pub fp: Fingerprint,
}

/// Read step 3: the missed records (indexes into `wanted`) that are adjacent in one segment,
/// grouped to be read with one call; a group is a range of `missed`.
pub(super) fn adjacent_groups(wanted: &[Wanted], missed: &[usize]) -> Vec<(usize, usize)> {
    let mut groups: Vec<(usize, usize)> = Vec::new();
    for (m, &k) in missed.iter().enumerate() {
        let w = &wanted[k];
        match groups.last_mut() {
            Some((_, e))
                if {
                    let prev = &wanted[missed[*e - 1]].loc;
                    prev.segment == w.loc.segment
                        && u64::from(prev.offset) + prev.record_bytes() == u64::from(w.loc.offset)
                } =>
            {
                *e = m + 1
            }
            _ => groups.push((m, m + 1)),
        }
    }
    groups
}

/// On a store whose reads cost requests: hint every group of adjacent records at once (when
/// there are more than one), so that they are fetched side by side.
pub(super) fn hint_groups(wanted: &[Wanted], missed: &[usize], groups: &[(usize, usize)]) {
    if groups.len() > 1 {
        for &g in groups {
            let (start, len) = group_span(wanted, missed, g);
            wanted[missed[g.0]].file.will_need(start, len);
        }
    }
}

/// The offset and length of one group's records in their segment.
fn group_span(wanted: &[Wanted], missed: &[usize], (s, e): (usize, usize)) -> (u64, u64) {
    let first_loc = &wanted[missed[s]].loc;
    let last_loc = &wanted[missed[e - 1]].loc;
    let start = u64::from(first_loc.offset);
    (
        start,
        u64::from(last_loc.offset) + last_loc.record_bytes() - start,
    )
}

/// Read step 3: one group's records with one read into a buffer of `spare`; returns its
/// offset and bytes.
pub(super) fn read_group(
    wanted: &[Wanted],
    missed: &[usize],
    (s, e): (usize, usize),
    name: &str,
    spare: &ReadBuffers,
) -> Result<(u64, Vec<u8>)> {
    let first = &wanted[missed[s]];
    let first_loc = &first.loc;
    let (start, len) = group_span(wanted, missed, (s, e));
    let mut buf = spare.take(len as usize);
    first.file.read_at(&mut buf, start).map_err(|err| {
        Error::io(
            format!(
                "reading segment {} at offset {start} for volume {name:?}",
                first_loc.segment
            ),
            err,
        )
    })?;
    Ok((start, buf))
}

/// Buffers of finished reads kept for the next ones, so that a read does not ask the
/// allocator for fresh zeroed memory each time (a measurable share of a sequential read's
/// CPU). A buffer is handed out at exactly the length asked for; its old bytes are
/// overwritten by the read it is taken for before anything looks at them.
///
/// Bounded: at most [`ReadBuffers::KEPT`] buffers of at most [`ReadBuffers::MAX_BYTES`]
/// each are kept; larger or further ones are freed.
#[derive(Default)]
pub(crate) struct ReadBuffers {
    kept: std::sync::Mutex<Vec<Vec<u8>>>,
}

impl ReadBuffers {
    const KEPT: usize = 16;
    const MAX_BYTES: usize = 2 << 20;

    /// A buffer of `len` bytes (their values are whatever the last read left).
    fn take(&self, len: usize) -> Vec<u8> {
        let mut buf = lock(&self.kept).pop().unwrap_or_default();
        // Shrinking keeps the capacity; growing zeroes only the new part.
        buf.resize(len, 0);
        buf
    }

    /// Keep these buffers for later reads, up to the bounds.
    pub(super) fn give_back(&self, bufs: impl Iterator<Item = Vec<u8>>) {
        let mut kept = lock(&self.kept);
        for buf in bufs {
            if kept.len() < Self::KEPT && buf.capacity() <= Self::MAX_BYTES {
                kept.push(buf);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ReadBuffers;
    use crate::locks::lock;

    #[test]
    fn read_buffers_are_handed_out_at_the_length_asked_and_kept_within_bounds() {
        let spare = ReadBuffers::default();
        let mut a = spare.take(100);
        assert_eq!(a.len(), 100);
        a.fill(7);
        spare.give_back(std::iter::once(a));
        // Reused, shorter: the length asked for, not the old one.
        let b = spare.take(10);
        assert_eq!(b.len(), 10);
        assert!(b.capacity() >= 100, "the kept buffer was not reused");
        spare.give_back(std::iter::once(b));
        // Longer than any kept buffer: grown to the length asked.
        assert_eq!(spare.take(5000).len(), 5000);
        // No more than KEPT buffers, and none over MAX_BYTES, are kept.
        let many = (0..ReadBuffers::KEPT + 5).map(|_| vec![0u8; 64]);
        spare.give_back(many);
        assert_eq!(lock(&spare.kept).len(), ReadBuffers::KEPT);
        let spare = ReadBuffers::default();
        spare.give_back(std::iter::once(vec![0u8; ReadBuffers::MAX_BYTES + 1]));
        assert!(lock(&spare.kept).is_empty());
    }
}

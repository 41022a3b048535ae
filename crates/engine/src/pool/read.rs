//! The read path: block-map entries, then chunk records from the cache tier or segments.

use crate::error::{Error, Result};
use crate::format::*;
use crate::locks::lock;
use crate::reduction::{self};
use rayon::prelude::*;
use std::sync::atomic::Ordering;

use super::{in_volume, with_context, Pool};

impl Pool {
    /// Read `out.len() / block_size` whole blocks from block `first`.
    pub(crate) fn read_blocks(
        &self,
        vol: u32,
        name: &str,
        first: u64,
        out: &mut [u8],
    ) -> Result<()> {
        let bs = self.sb.block_size as usize;
        let n = out.len() / bs;
        // Where each block's bytes are: (index in out, chunk id, location, file).
        let mut wanted = Vec::new();
        let mut in_memory: Vec<Option<Vec<u8>>> = Vec::new();
        {
            let mut st = lock(&self.state);
            st.md.volume_for(vol, name, "read", first, n as u64)?;
            let mut entries = Vec::with_capacity(n);
            let looked_up = crate::block_map::get_range(
                &mut st.md.cache,
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
                if e == ENTRY_LOST {
                    if !self.lost_reads_zeros.load(Ordering::Relaxed) {
                        self.read_errors.fetch_add(1, Ordering::Relaxed);
                        return Err(Error::Lost {
                            volume: name.to_string(),
                            block: first + i as u64,
                        });
                    }
                    self.lost_read_as_zeros.fetch_add(1, Ordering::Relaxed);
                }
                if e == ENTRY_ZERO || e == ENTRY_UNMAPPED || e == ENTRY_LOST {
                    out[i * bs..(i + 1) * bs].fill(0);
                    continue;
                }
                let md = &mut st.md;
                let loc = md.chunks.get(&mut md.cache, e).and_then(|c| {
                    c.map(|c| (c.loc, c.fp)).ok_or_else(|| {
                        Error::corrupt(
                            format!("volume {name:?} block {}", first + i as u64),
                            format!("chunk {e} does not exist (damaged metadata)"),
                        )
                    })
                });
                let (loc, fp) = match loc {
                    Ok(l) => l,
                    Err(err) => {
                        self.read_errors.fetch_add(1, Ordering::Relaxed);
                        return Err(with_context(
                            err,
                            &format!("volume {name:?} block {}", first + i as u64),
                        ));
                    }
                };
                let file = st.segments.file(loc.segment).ok_or_else(|| {
                    Error::corrupt(
                        format!("volume {name:?} block {}", first + i as u64),
                        format!("segment {} of chunk {e} is missing", loc.segment),
                    )
                })?;
                // Staged or being written: not in the file yet.
                in_memory.push(st.segments.in_memory(&loc));
                wanted.push((i, e, loc, file, fp));
            }
            if let Err(e) = st.md.cache.evict_to_budget() {
                st.poisoned = Some(e.to_string());
                return Err(e);
            }
        }
        // The cache tier first: a hit is the record exactly as the segment holds it. A miss
        // is read from its segment, or from memory while it is staged or being written.
        let cache = self.cache();
        let mut cached: Vec<Option<Vec<u8>>> = vec![None; wanted.len()];
        if let Some(c) = &cache {
            for (k, w) in wanted.iter().enumerate() {
                cached[k] = c.lookup(w.1, &w.4, &w.2);
            }
        }
        let cache_misses = cached.iter().filter(|c| c.is_none()).count();
        let missed: Vec<usize> = (0..wanted.len())
            .filter(|&k| cached[k].is_none() && in_memory[k].is_none())
            .collect();
        // Coalesce missed records that are adjacent in one segment into one read; a group
        // is a range of `missed`.
        let mut groups: Vec<(usize, usize)> = Vec::new();
        for (m, &k) in missed.iter().enumerate() {
            let w = &wanted[k];
            match groups.last_mut() {
                Some((_, e))
                    if {
                        let prev = &wanted[missed[*e - 1]].2;
                        prev.segment == w.2.segment
                            && u64::from(prev.offset) + prev.record_bytes() == u64::from(w.2.offset)
                    } =>
                {
                    *e = m + 1
                }
                _ => groups.push((m, m + 1)),
            }
        }
        // Read each group with one call, then check and decode every block (in parallel for
        // large reads).
        let read_group = |&(s, e): &(usize, usize)| -> Result<(u64, Vec<u8>)> {
            let first = &wanted[missed[s]];
            let first_loc = &first.2;
            let last_loc = &wanted[missed[e - 1]].2;
            let start = u64::from(first_loc.offset);
            let len = (u64::from(last_loc.offset) + last_loc.record_bytes() - start) as usize;
            let mut buf = vec![0u8; len];
            first.3.read_at(&mut buf, start).map_err(|err| {
                Error::io(
                    format!(
                        "reading segment {} at offset {start} for volume {name:?}",
                        first_loc.segment
                    ),
                    err,
                )
            })?;
            Ok((start, buf))
        };
        let parallel = wanted.len() >= 32;
        let bufs: Result<Vec<(u64, Vec<u8>)>> = if parallel && groups.len() >= 4 {
            groups.par_iter().map(read_group).collect()
        } else {
            groups.iter().map(read_group).collect()
        };
        let result = bufs.and_then(|bufs| {
            // For each block of `out`: (group or None for a cache hit, wanted index), or
            // None for zeros.
            let mut slot: Vec<Option<(Option<usize>, usize)>> = vec![None; n];
            for (g, &(s, e)) in groups.iter().enumerate() {
                for &k in &missed[s..e] {
                    slot[wanted[k].0] = Some((Some(g), k));
                }
            }
            for (k, (c, m)) in cached.iter().zip(&in_memory).enumerate() {
                if c.is_some() || m.is_some() {
                    slot[wanted[k].0] = Some((None, k));
                }
            }
            let decode = |(i, dst): (usize, &mut [u8])| -> Result<()> {
                let Some((g, k)) = slot[i] else { return Ok(()) };
                let (_, id, loc, _, fp) = &wanted[k];
                let record: &[u8] = match (g, &cached[k], &in_memory[k]) {
                    (Some(g), _, _) => {
                        let (start, buf) = &bufs[g];
                        &buf[(u64::from(loc.offset) - start) as usize..]
                    }
                    (None, Some(c), _) | (None, None, Some(c)) => c,
                    (None, None, None) => return Ok(()),
                };
                let what = || {
                    format!(
                        "volume {name:?} block {} (chunk {id}, segment {}, offset {})",
                        first + i as u64,
                        loc.segment,
                        loc.offset
                    )
                };
                let payload = open_record(record, *id, loc, self.crypto.as_deref(), Some(fp), what)
                    .map_err(|err| with_context(err, &what()))?;
                reduction::decompress(loc.codec, &payload, dst, what)?;
                let from_segment = cached[k].is_none();
                if let (Some(c), true) = (&cache, from_segment) {
                    if let Some(r) = record.get(..loc.record_bytes() as usize) {
                        c.offer(*id, fp, r);
                    }
                }
                Ok(())
            };
            if parallel {
                out.par_chunks_mut(bs).enumerate().try_for_each(decode)
            } else {
                out.chunks_mut(bs).enumerate().try_for_each(decode)
            }
        });
        if let Some(c) = &cache {
            let hits = (wanted.len() - cache_misses) as u64;
            c.count(hits, cache_misses as u64, bs as u64);
        }
        if let Err(e) = &result {
            if e.is_damage() {
                self.read_errors.fetch_add(1, Ordering::Relaxed);
                // The client only sees EIO: the log says what and where.
                tracing::error!("read failed: {e}");
            }
        }
        result
    }

    /// The map entries of `count` blocks from `first`.
    pub(crate) fn map_entries(
        &self,
        vol: u32,
        name: &str,
        first: u64,
        count: u64,
    ) -> Result<Vec<(u64, u64)>> {
        let mut st = lock(&self.state);
        st.md.volume_for(vol, name, "block_status", first, count)?;
        let r = crate::block_map::mapped(&mut st.md.cache, u64::from(vol), first, first + count)
            .map_err(|e| in_volume(e, name, &format!("blocks {first}..{}", first + count)));
        st.md.cache.evict_to_budget()?;
        r
    }
}

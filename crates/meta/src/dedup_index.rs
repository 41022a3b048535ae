//! The dedup index: fingerprint → the chunk-table page holding that chunk. Advisory
//! (docs/DESIGN.md invariant 3): a miss costs savings, never correctness.
//!
//! Owns: the only per-chunk structure kept in RAM, at 6 bytes a slot (about 7–8 bytes per
//! unique chunk at the table's 75–90 % load).
//!
//! Design (why, in docs/ARCHITECTURE.md): chunk ids are handed out in order, so a chunk's
//! record sits on chunk-table page `id / 128`. A slot holds that page number (28 bits) and 20
//! bits of the fingerprint; 12 more bits choose one of 4096 shards. A lookup returns the
//! candidate pages whose 32 fingerprint bits match; the caller reads each page (through the
//! page cache) and compares full fingerprints, so dedup stays exact. A slot's position is a
//! function of the bits it stores, so a shard grows (by 1.25×, at 90 % load) without reading
//! any fingerprint back, and deletion shifts entries back (no tombstones).
//! Each shard is a Robin Hood table (an entry never sits further from its home slot than
//! the one it passed), so entries are kept in the order of their home slots and a lookup
//! stops at the first entry whose home lies past its own: a miss, the common case when
//! writing new data, reads a few slots even at 90 % load, where plain linear probing reads
//! about fifty.
//! Limits: pages past 2^28 − 1 (chunk ids past 2^35, 128 TiB of unique 4 KiB blocks) are not
//! indexed: their chunks are stored but not deduplicated against.

use condense_format::dedup_index::{
    decode_dedup_index_header, decode_shard_head, decode_slots, encode_dedup_index_header,
    encode_shard_head, encode_slots, DedupIndexHeader, IndexStamp, DEDUP_INDEX_HEADER_BYTES,
    DEDUP_INDEX_NAME, SHARD_HEAD_BYTES, SLOT_BYTES,
};
use condense_format::error::{Error, Result};
use condense_format::Fingerprint;
use condense_store::io::File;

const SHARD_BITS: u32 = 12;
const SHARDS: usize = 1 << SHARD_BITS;
const HASH_BITS: u32 = 20;
const PAGE_BITS: u32 = 28;
/// Pages at or above this are not indexed.
pub const PAGE_LIMIT: u64 = (1 << PAGE_BITS) - 1;

/// One slot, 6 bytes in one place (a probe touches one cache line, not two arrays):
/// `[0]` the low 16 of the 20 stored hash bits; `[1]`, `[2]` the low and high halves of
/// `hi` = high 4 hash bits << 28 | (page + 1), 0 for an empty slot.
type Slot = [u16; 3];

#[derive(Default, Clone)]
struct Shard {
    slots: Vec<Slot>,
    len: usize,
}

fn split(fp: &Fingerprint) -> (usize, u32) {
    let x = u32::from_le_bytes([fp[0], fp[1], fp[2], fp[3]]);
    let y = u32::from_le_bytes([fp[4], fp[5], fp[6], fp[7]]);
    (
        (x & ((1 << SHARD_BITS) - 1)) as usize,
        y & ((1 << HASH_BITS) - 1),
    )
}

impl Shard {
    fn cap(&self) -> usize {
        self.slots.len()
    }

    fn lo(&self, i: usize) -> u16 {
        self.slots[i][0]
    }

    fn hi(&self, i: usize) -> u32 {
        u32::from(self.slots[i][1]) | u32::from(self.slots[i][2]) << 16
    }

    fn slot(lo: u16, hi: u32) -> Slot {
        [lo, hi as u16, (hi >> 16) as u16]
    }

    fn home(&self, h: u32) -> usize {
        ((u64::from(h) * self.cap() as u64) >> HASH_BITS) as usize
    }

    fn hash_at(&self, i: usize) -> u32 {
        u32::from(self.lo(i)) | (self.hi(i) >> PAGE_BITS) << 16
    }

    fn next(&self, i: usize) -> usize {
        if i + 1 == self.cap() {
            0
        } else {
            i + 1
        }
    }

    /// Robin Hood insertion. The table keeps entries in the order of their home slots, so
    /// the entry goes where its probe would stop (the first empty slot or entry with a later
    /// home) and the rest of that run moves up one slot. Only the first step compares homes;
    /// the move is a copy (at 90 % load a run goes on for tens of slots past the insertion
    /// point, and comparing each resident's home cost 5 % of a write's CPU).
    fn put(&mut self, h: u32, page: u64) {
        let entry = Self::slot(h as u16, (h >> 16) << PAGE_BITS | (page as u32 + 1));
        let mut at = self.home(h);
        let mut dist = 0;
        while self.hi(at) != 0 && self.distance(at) >= dist {
            at = self.next(at);
            dist += 1;
        }
        let mut end = at;
        while self.hi(end) != 0 {
            end = self.next(end);
        }
        // Move [at, end) up one slot, wrapping past the last slot to the first.
        if end >= at {
            self.slots.copy_within(at..end, at + 1);
        } else {
            let last = self.cap() - 1;
            self.slots.copy_within(0..end, 1);
            self.slots[0] = self.slots[last];
            self.slots.copy_within(at..last, at + 1);
        }
        self.slots[at] = entry;
        self.len += 1;
    }

    /// The slots that may hold entries with hash `h`: from its home slot to the first empty
    /// slot or entry with a later home.
    fn probe(&self, h: u32) -> impl Iterator<Item = usize> + '_ {
        let mut i = self.home(h);
        let mut dist = 0;
        std::iter::from_fn(move || {
            if self.hi(i) == 0 || self.distance(i) < dist {
                return None;
            }
            let at = i;
            i = self.next(i);
            dist += 1;
            Some(at)
        })
    }

    fn grow(&mut self) {
        self.resize((self.cap() * 5 / 4).max(self.cap() + 8));
    }

    fn resize(&mut self, new_cap: usize) {
        let old = std::mem::replace(
            self,
            Shard {
                slots: vec![[0; 3]; new_cap],
                len: 0,
            },
        );
        for i in 0..old.cap() {
            if old.hi(i) != 0 {
                let h = old.hash_at(i);
                self.put(h, u64::from(old.hi(i) & ((1 << PAGE_BITS) - 1)) - 1);
            }
        }
    }

    /// Distance of the entry at `i` from its home slot.
    fn distance(&self, i: usize) -> usize {
        let home = self.home(self.hash_at(i));
        if i >= home {
            i - home
        } else {
            i + self.cap() - home
        }
    }
}

pub struct DedupIndex {
    shards: Vec<Shard>,
    len: u64,
    /// Bytes of shard arrays freed by growth since memory was last handed back to the OS.
    freed: u64,
    /// Slots of all shards together (kept, so `ram_bytes` on every commit costs nothing).
    slots: u64,
}

/// Growth frees this much before the allocator is asked to return free memory.
const TRIM_EVERY: u64 = 32 << 20;

/// Hand freed heap memory back to the OS. All shards grow at about the same time (their loads
/// are alike), and each growth frees arrays the new, larger ones cannot reuse; without this
/// the freed arrays of one growth wave stay resident, ~80 % of the index again.
pub fn return_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free pages of glibc's heaps; it takes no pointers
    // and is safe to call from any thread at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

impl Default for DedupIndex {
    fn default() -> Self {
        DedupIndex {
            shards: vec![Shard::default(); SHARDS],
            len: 0,
            freed: 0,
            slots: 0,
        }
    }
}

impl DedupIndex {
    /// An empty index sized for `chunks` entries spread over the shards (three standard
    /// deviations of headroom, at 90 % load), so building it at open does not grow (and
    /// reallocate) every shard a dozen times.
    pub fn with_capacity(chunks: u64) -> DedupIndex {
        let mut ix = DedupIndex::default();
        let lambda = chunks as f64 / SHARDS as f64;
        if lambda >= 1.0 {
            let cap = ((lambda + 3.0 * lambda.sqrt()) / 0.9).ceil() as usize + 1;
            for shard in &mut ix.shards {
                shard.resize(cap);
            }
            ix.slots = (cap * SHARDS) as u64;
        }
        ix
    }

    /// Ask the CPU to load the slots a lookup or insert of `fp` starts at, so a loop over
    /// many fingerprints can overlap their cache misses (a miss costs more than the probe).
    pub fn prefetch(&self, fp: &Fingerprint) {
        let (s, h) = split(fp);
        let shard = &self.shards[s];
        if shard.cap() == 0 {
            return;
        }
        let slot: *const Slot = &shard.slots[shard.home(h)];
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a prefetch is only a hint: it never faults and changes no memory; the
        // pointer is to a live element anyway.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                slot.cast::<i8>(),
            );
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = slot;
    }

    /// Chunk-table pages that may hold a chunk with this fingerprint (most often none or one).
    pub fn candidates(&self, fp: &Fingerprint, out: &mut Vec<u64>) {
        let (s, h) = split(fp);
        let shard = &self.shards[s];
        if shard.cap() == 0 {
            return;
        }
        for i in shard.probe(h) {
            if shard.hash_at(i) == h {
                let page = u64::from(shard.hi(i) & ((1 << PAGE_BITS) - 1)) - 1;
                if !out.contains(&page) {
                    out.push(page);
                }
            }
        }
    }

    /// Index a chunk with fingerprint `fp` on chunk-table page `page`.
    pub fn insert(&mut self, fp: &Fingerprint, page: u64) {
        if page >= PAGE_LIMIT {
            return;
        }
        let (s, h) = split(fp);
        let shard = &mut self.shards[s];
        if (shard.len + 1) * 10 > shard.cap() * 9 {
            let old = shard.cap() as u64;
            shard.grow();
            self.slots += shard.cap() as u64 - old;
            self.freed += old * 6;
            if self.freed >= TRIM_EVERY {
                self.freed = 0;
                return_free_memory();
            }
        }
        self.shards[s].put(h, page);
        self.len += 1;
    }

    /// Remove one entry for `fp` on `page`, if any (entries with the same stored bits and
    /// page are interchangeable, so any one of them will do).
    pub fn remove(&mut self, fp: &Fingerprint, page: u64) {
        if page >= PAGE_LIMIT {
            return;
        }
        let (s, h) = split(fp);
        let shard = &mut self.shards[s];
        if shard.cap() == 0 {
            return;
        }
        let want = (h >> 16) << PAGE_BITS | (page as u32 + 1);
        let Some(i) = shard
            .probe(h)
            .find(|&i| shard.lo(i) == h as u16 && shard.hi(i) == want)
        else {
            return;
        };
        // Backward-shift deletion: the entries after it that are not home move back one
        // slot (which keeps the Robin Hood order).
        let mut gap = i;
        let mut j = shard.next(i);
        while shard.hi(j) != 0 && shard.distance(j) > 0 {
            shard.slots[gap] = shard.slots[j];
            gap = j;
            j = shard.next(j);
        }
        shard.slots[gap] = [0; 3];
        shard.len -= 1;
        self.len -= 1;
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of memory the index holds.
    pub fn ram_bytes(&self) -> u64 {
        self.slots * 6 + (SHARDS * std::mem::size_of::<Shard>()) as u64
    }
}

/// A saved index found at open whose header names the root the pool opened at (loaded by
/// [`crate::metadata::Metadata::build_index`]).
pub struct SavedIndex {
    pub file: std::sync::Arc<dyn File>,
    pub uuid: [u8; 16],
    pub stamp: IndexStamp,
}

/// Where the index in RAM came from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum IndexOrigin {
    /// Not built yet (the first write that needs it builds it).
    #[default]
    NotBuilt,
    /// Loaded from the index saved at the last clean close.
    Loaded,
    /// Built from the chunk table (no saved index, or one of another checkpoint).
    Built,
}

impl IndexOrigin {
    pub fn as_str(self) -> &'static str {
        match self {
            IndexOrigin::NotBuilt => "not built",
            IndexOrigin::Loaded => "loaded",
            IndexOrigin::Built => "built",
        }
    }
}

/// Bytes written or read at a time while saving or loading.
const FILE_PIECE: usize = 8 << 20;

/// Saving at a clean close and loading at the next open (`dedup.idx`,
/// [`condense_format::dedup_index`]): the file is the shards' arrays as they are, so loading
/// costs one read of it, not a walk of the chunk table.
impl DedupIndex {
    /// Write the index to `file` (replacing what it held), saved at `stamp` of pool `uuid`.
    pub fn save(&self, file: &dyn File, uuid: [u8; 16], stamp: IndexStamp) -> Result<()> {
        let io = |e| Error::io("writing the saved dedup index", e);
        file.set_len(0).map_err(io)?;
        let mut at = DEDUP_INDEX_HEADER_BYTES as u64;
        let mut body_crc = 0u32;
        let mut buf = Vec::with_capacity(FILE_PIECE + SHARD_HEAD_BYTES);
        for (i, shard) in self.shards.iter().enumerate() {
            buf.extend_from_slice(&encode_shard_head(shard.cap() as u32, shard.len as u32));
            encode_slots(&shard.slots, &mut buf);
            if buf.len() >= FILE_PIECE || i + 1 == self.shards.len() {
                body_crc = crc32c::crc32c_append(body_crc, &buf);
                file.write_at(&buf, at).map_err(io)?;
                at += buf.len() as u64;
                buf.clear();
            }
        }
        let header = DedupIndexHeader {
            uuid,
            stamp,
            shards: SHARDS as u32,
            entries: self.len,
            body_crc,
        };
        file.write_at(&encode_dedup_index_header(&header), 0)
            .map_err(io)
    }

    /// The index saved in `file` at `stamp` of pool `uuid`. An error if the file was saved
    /// at another checkpoint or fails any check: the caller then builds the index from the
    /// chunk table. Never allocates more than the file holds.
    pub fn load(file: &dyn File, uuid: [u8; 16], stamp: IndexStamp) -> Result<DedupIndex> {
        let io = |e| Error::io("reading the saved dedup index", e);
        let file_len = file.len().map_err(io)?;
        let mut head = vec![0u8; DEDUP_INDEX_HEADER_BYTES];
        if file_len < head.len() as u64 {
            return Err(Error::corrupt(DEDUP_INDEX_NAME, "shorter than its header"));
        }
        file.read_at(&mut head, 0).map_err(io)?;
        let h = decode_dedup_index_header(&head)?;
        if h.uuid != uuid || h.stamp != stamp || h.shards != SHARDS as u32 {
            return Err(Error::corrupt(
                DEDUP_INDEX_NAME,
                "saved at another checkpoint of the pool (or of another pool)",
            ));
        }
        let mut ix = DedupIndex::default();
        let mut at = DEDUP_INDEX_HEADER_BYTES as u64;
        let mut body_crc = 0u32;
        let mut bytes = Vec::new();
        for shard in &mut ix.shards {
            let mut sh = [0u8; SHARD_HEAD_BYTES];
            if at + SHARD_HEAD_BYTES as u64 > file_len {
                return Err(Error::corrupt(DEDUP_INDEX_NAME, "truncated"));
            }
            file.read_at(&mut sh, at).map_err(io)?;
            body_crc = crc32c::crc32c_append(body_crc, &sh);
            at += SHARD_HEAD_BYTES as u64;
            let (cap, len) = decode_shard_head(&sh);
            let slot_bytes = u64::from(cap) * SLOT_BYTES as u64;
            // The load rule of `insert` (at most 90 % full) leaves an empty slot, where every
            // probe stops.
            if at + slot_bytes > file_len || u64::from(len) * 10 > u64::from(cap) * 9 {
                return Err(Error::corrupt(
                    DEDUP_INDEX_NAME,
                    format!("a shard of {len} entries in {cap} slots at offset {at}"),
                ));
            }
            bytes.resize(slot_bytes as usize, 0);
            file.read_at(&mut bytes, at).map_err(io)?;
            body_crc = crc32c::crc32c_append(body_crc, &bytes);
            at += slot_bytes;
            let mut slots = Vec::with_capacity(cap as usize);
            decode_slots(&bytes, &mut slots);
            *shard = Shard {
                slots,
                len: len as usize,
            };
            // Every entry names a page (page + 1 in its low bits), and `len` counts them.
            let (mut used, mut pageless) = (0, false);
            for i in 0..shard.cap() {
                let hi = shard.hi(i);
                if hi != 0 {
                    used += 1;
                    pageless |= hi & ((1 << PAGE_BITS) - 1) == 0;
                }
            }
            if used != shard.len || pageless {
                return Err(Error::corrupt(
                    DEDUP_INDEX_NAME,
                    format!("a shard's slots do not match its length at offset {at}"),
                ));
            }
            ix.len += len as u64;
            ix.slots += u64::from(cap);
        }
        if at != file_len || ix.len != h.entries || body_crc != h.body_crc {
            return Err(Error::Checksum {
                what: DEDUP_INDEX_NAME.into(),
                expected: h.body_crc,
                found: body_crc,
            });
        }
        Ok(ix)
    }
}

/// Bytes of `dedup.idx` for the index [`projected_ram_bytes`] projects: its slots, the
/// shards' heads and the header (for `condense estimate`: a clean close leaves the file).
/// None without chunks: a pool never written to builds no index, and saves none.
pub fn projected_file_bytes(chunks: u64) -> u64 {
    if chunks == 0 {
        return 0;
    }
    let fixed = (SHARDS * std::mem::size_of::<Shard>()) as u64;
    (DEDUP_INDEX_HEADER_BYTES + SHARDS * SHARD_HEAD_BYTES) as u64
        + projected_ram_bytes(chunks).saturating_sub(fixed)
}

/// What [`DedupIndex::ram_bytes`] will be after `chunks` inserts spread at random over the
/// shards (for `condense estimate`, and for `stats` before the index is built): the expected
/// capacity of a shard under a Poisson load, following the same growth rule as `insert`.
pub fn projected_ram_bytes(chunks: u64) -> u64 {
    let fixed = (SHARDS * std::mem::size_of::<Shard>()) as u64;
    let lambda = chunks as f64 / SHARDS as f64;
    if lambda == 0.0 {
        return fixed;
    }
    let last = (lambda + 12.0 * lambda.sqrt() + 30.0) as u64;
    let (mut cap, mut ln_p, mut slots) = (0u64, -lambda, 0.0f64);
    for k in 0..=last {
        if k > 0 {
            ln_p += lambda.ln() - (k as f64).ln();
            if k * 10 > cap * 9 {
                cap = (cap * 5 / 4).max(cap + 8);
            }
        }
        slots += ln_p.exp() * cap as f64;
    }
    fixed + (SHARDS as f64 * slots * 6.0) as u64
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::sync::Arc;

    /// A fingerprint for test number `n` (also the sparse index's tests').
    pub(crate) fn fp(n: u64) -> Fingerprint {
        let h = blake3::hash(&n.to_le_bytes());
        let mut f = [0u8; 16];
        f.copy_from_slice(&h.as_bytes()[..16]);
        f
    }

    #[test]
    fn finds_inserted_pages_and_forgets_removed_ones() {
        let mut ix = DedupIndex::default();
        let n = 200_000u64;
        for i in 0..n {
            ix.insert(&fp(i), i / 128);
        }
        assert_eq!(ix.len(), n);
        let mut c = Vec::new();
        for i in (0..n).step_by(7) {
            c.clear();
            ix.candidates(&fp(i), &mut c);
            assert!(c.contains(&(i / 128)), "chunk {i} lost");
        }
        // Remove every other one; the rest must still be found.
        for i in (0..n).step_by(2) {
            ix.remove(&fp(i), i / 128);
        }
        assert_eq!(ix.len(), n / 2);
        let mut false_hits = 0;
        for i in 0..n {
            c.clear();
            ix.candidates(&fp(i), &mut c);
            if i % 2 == 1 {
                assert!(c.contains(&(i / 128)), "chunk {i} lost after removals");
            } else if c.contains(&(i / 128)) {
                false_hits += 1;
            }
        }
        // Removed chunks may only show up through a 32-bit collision with a neighbour.
        assert!(false_hits < 10, "{false_hits} removed chunks still indexed");
        assert_robin_hood_order(&ix);
        let per = ix.ram_bytes() as f64 / ix.len() as f64;
        assert!(per < 20.0, "{per} bytes per entry");
    }

    /// Every occupied slot followed by an occupied one: the second is at most one slot
    /// further from its home (what lets a lookup stop early).
    fn assert_robin_hood_order(ix: &DedupIndex) {
        for shard in &ix.shards {
            for i in 0..shard.cap() {
                let j = shard.next(i);
                if shard.hi(i) != 0 && shard.hi(j) != 0 {
                    assert!(shard.distance(j) <= shard.distance(i) + 1);
                }
            }
        }
    }

    /// Inserts whose runs wrap past the last slot: every entry is still found by its probe,
    /// in home order.
    #[test]
    fn runs_wrapping_past_the_last_slot_keep_their_order() {
        let mut shard = Shard::default();
        shard.resize(8);
        // A hash whose home is `slot`.
        let home_of = |slot: u32| (slot << HASH_BITS) / 8;
        // Three for the last slot, then two each for slots 6 and 0: the last slot's run
        // wraps to the front, and the later inserts land inside wrapped runs.
        let hashes = [
            home_of(7),
            home_of(7) + 1,
            home_of(7) + 2,
            home_of(6),
            home_of(0),
            home_of(6) + 1,
            home_of(0) + 1,
        ];
        for (page, &h) in hashes.iter().enumerate() {
            shard.put(h, page as u64);
        }
        assert_eq!(shard.len, hashes.len());
        for (page, &h) in hashes.iter().enumerate() {
            let found = shard.probe(h).any(|i| {
                shard.hash_at(i) == h
                    && u64::from(shard.hi(i) & ((1 << PAGE_BITS) - 1)) == page as u64 + 1
            });
            assert!(found, "entry {page} (hash {h:#x}) lost");
        }
        let mut ix = DedupIndex::default();
        ix.shards[0] = shard;
        assert_robin_hood_order(&ix);
    }

    #[test]
    fn a_miss_reads_few_slots_at_full_load() {
        let mut ix = DedupIndex::default();
        for i in 0..300_000u64 {
            ix.insert(&fp(i), i / 128);
        }
        assert_robin_hood_order(&ix);
        let (mut probes, misses) = (0usize, 20_000u64);
        for i in 0..misses {
            let (s, h) = split(&fp(1_000_000 + i));
            probes += ix.shards[s].probe(h).count();
        }
        let mean = probes as f64 / misses as f64;
        assert!(mean < 8.0, "a miss reads {mean} slots on average");
    }

    #[test]
    fn projected_ram_is_close_to_a_real_index() {
        for n in [2_000u64, 30_000, 200_000] {
            let mut ix = DedupIndex::default();
            for i in 0..n {
                ix.insert(&fp(i), i / 128);
            }
            let slots: u64 = ix.shards.iter().map(|s| s.cap() as u64).sum();
            assert_eq!(ix.slots, slots, "slot count kept in step with the shards");
            let mut sized = DedupIndex::with_capacity(n);
            for i in 0..n {
                sized.insert(&fp(i), i / 128);
            }
            let sized_slots: u64 = sized.shards.iter().map(|s| s.cap() as u64).sum();
            assert_eq!(sized.slots, sized_slots);
            let (real, proj) = (ix.ram_bytes(), projected_ram_bytes(n));
            assert!(
                real.abs_diff(proj) * 20 <= real,
                "{n} chunks: projected {proj}, real {real}"
            );
        }
    }

    fn saved(ix: &DedupIndex, stamp: IndexStamp) -> Result<Arc<dyn File>> {
        let dir = condense_store::sim::SimHandle(condense_store::sim::SimDir::new());
        let f = condense_store::io::Dir::open(&dir, DEDUP_INDEX_NAME, true)
            .map_err(|e| Error::io("creating", e))?;
        ix.save(&*f, [3; 16], stamp)?;
        Ok(f)
    }

    fn stamp() -> IndexStamp {
        IndexStamp {
            journal_gen: 4,
            next_seq: 99,
            live_chunks: 50_000,
            ..Default::default()
        }
    }

    #[test]
    fn a_saved_index_loads_with_the_same_answers() -> Result<()> {
        let mut ix = DedupIndex::default();
        for i in 0..50_000u64 {
            ix.insert(&fp(i), i / 128);
        }
        for i in (0..50_000u64).step_by(5) {
            ix.remove(&fp(i), i / 128);
        }
        let f = saved(&ix, stamp())?;
        let back = DedupIndex::load(&*f, [3; 16], stamp())?;
        assert_eq!(back.len(), ix.len());
        assert_eq!(back.ram_bytes(), ix.ram_bytes());
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for i in 0..60_000u64 {
            a.clear();
            b.clear();
            ix.candidates(&fp(i), &mut a);
            back.candidates(&fp(i), &mut b);
            assert_eq!(a, b, "fingerprint {i}");
        }
        Ok(())
    }

    #[test]
    fn another_checkpoint_or_a_damaged_file_is_not_loaded() -> Result<()> {
        let mut ix = DedupIndex::default();
        for i in 0..5_000u64 {
            ix.insert(&fp(i), i / 128);
        }
        let f = saved(&ix, stamp())?;
        let other = IndexStamp {
            next_seq: 100,
            ..stamp()
        };
        assert!(DedupIndex::load(&*f, [3; 16], other).is_err());
        assert!(DedupIndex::load(&*f, [4; 16], stamp()).is_err());
        let len = f.len().map_err(|e| Error::io("len", e))?;
        for at in [0, 130, len / 2, len - 1] {
            let g = saved(&ix, stamp())?;
            let mut b = [0u8; 1];
            g.read_at(&mut b, at).map_err(|e| Error::io("read", e))?;
            g.write_at(&[b[0] ^ 0x10], at)
                .map_err(|e| Error::io("write", e))?;
            assert!(
                DedupIndex::load(&*g, [3; 16], stamp()).is_err(),
                "flip at {at}"
            );
        }
        let g = saved(&ix, stamp())?;
        g.set_len(len - 6).map_err(|e| Error::io("cut", e))?;
        assert!(DedupIndex::load(&*g, [3; 16], stamp()).is_err());
        Ok(())
    }

    /// A file whose checksums are right but whose shard is full (no empty slot would stop a
    /// probe) or claims more slots than the file holds is refused, without allocating them.
    #[test]
    fn a_hostile_shard_with_good_checksums_is_refused() -> Result<()> {
        for (cap, len) in [(10u32, 10u32), (u32::MAX, 0)] {
            let mut body = Vec::new();
            body.extend_from_slice(&encode_shard_head(cap, len));
            let slots = vec![[1u16, 1, 0]; 10];
            encode_slots(&slots, &mut body);
            let header = DedupIndexHeader {
                uuid: [3; 16],
                stamp: stamp(),
                shards: SHARDS as u32,
                entries: u64::from(len),
                body_crc: crc32c::crc32c(&body),
            };
            let dir = condense_store::sim::SimHandle(condense_store::sim::SimDir::new());
            let f = condense_store::io::Dir::open(&dir, DEDUP_INDEX_NAME, true)
                .map_err(|e| Error::io("creating", e))?;
            f.write_at(&encode_dedup_index_header(&header), 0)
                .and_then(|_| f.write_at(&body, DEDUP_INDEX_HEADER_BYTES as u64))
                .map_err(|e| Error::io("writing", e))?;
            assert!(
                DedupIndex::load(&*f, [3; 16], stamp()).is_err(),
                "{cap}/{len}"
            );
        }
        Ok(())
    }
}

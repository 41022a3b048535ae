//! `condense estimate --delta` replays writes through `condense_meta::delta_replay` (the
//! write path's own delta search over a model sketch index): the same writes into a delta
//! pool must store, write for write, the same chunks, the same deltas and the same payload
//! bytes. Dedup is dense, so which blocks are new does not depend on the pool's key, nor do
//! super-features: the replay needs nothing of the pool's.

use condense_engine::delta_replay::{alone_sizes, DeltaReplay};
use condense_engine::reduction::{compressor_run, fingerprint, is_zero};
use condense_engine::sim::{SimDir, SimHandle, SimRng};
use condense_engine::{Compression, InitOptions, OpenOptions, Pool};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

const BS: usize = 4096;

/// Block `tag`: family `tag / 16` (text that compresses, or noise that does not, as the
/// family's number says; from 5000 on, noise ending in 700 zeros), variant `tag % 16` with 24 bytes of it changed (0: none), so the
/// variants of a family are near copies of each other.
fn block(tag: u64) -> Vec<u8> {
    let (family, variant) = (tag / 16, tag % 16);
    let mut rng = SimRng::new(family + 1);
    let mut b: Vec<u8> = if family % 3 == 0 || family >= 5000 {
        (0..BS).map(|_| rng.next_u64() as u8).collect()
    } else {
        const WORDS: [&[u8]; 8] = [
            b"pool ",
            b"chunk ",
            b"delta ",
            b"segment ",
            b"journal ",
            b"block ",
            b"map ",
            b"\n",
        ];
        let mut t = Vec::with_capacity(BS + 16);
        while t.len() < BS {
            t.extend_from_slice(WORDS[(rng.next_u64() % 8) as usize]);
            t.extend_from_slice(&rng.next_u64().to_le_bytes()[..(family % 4) as usize]);
        }
        t.truncate(BS);
        t
    };
    if family >= 5000 {
        // Noise to the compressor's eye (its byte sample), yet it saves 1/8: only tried
        // outside a run of noise.
        b[BS - 700..].fill(0);
    }
    if variant > 0 {
        let at = (variant as usize * 211) % (BS - 24);
        let mut v = SimRng::new(tag ^ 0xdead_beef);
        for x in &mut b[at..at + 24] {
            *x = v.next_u64() as u8;
        }
    }
    b
}

fn open(disk: &Arc<SimDir>) -> Arc<Pool> {
    let opts = OpenOptions {
        destage_in_background: false,
        release_in_background: false,
        ..Default::default()
    };
    Pool::open(Arc::new(SimHandle(disk.clone())), opts).expect("open")
}

/// The replay's side of a write: misses found as a dense index finds them (the first block
/// of each content not seen before), sized alone in the write path's compressor runs, then
/// replayed; the blocks it stored alone are kept as bases for later writes.
struct Model {
    replay: DeltaReplay,
    seen: HashSet<[u8; 16]>,
    blocks: HashMap<u64, Vec<u8>>,
    compression: Compression,
}

impl Model {
    fn write(&mut self, data: &[u8]) {
        let key = [7u8; 32];
        let mut misses = Vec::new();
        for (i, b) in data.chunks(BS).enumerate() {
            if !is_zero(b) && self.seen.insert(fingerprint(&key, b)) {
                misses.push(i);
            }
        }
        // The pool's writes here are alone in flight: spread over the cores.
        let per = compressor_run(misses.len(), rayon::current_num_threads(), true);
        let mut alone = HashMap::new();
        for run in misses.chunks(per) {
            for (&i, n) in run.iter().zip(alone_sizes(data, BS, run, self.compression)) {
                alone.insert(i, n);
            }
        }
        let blocks = &self.blocks;
        let stored = self
            .replay
            .write(data, BS, &misses, &|i| alone[&i], &mut |id| {
                blocks.get(&id).cloned()
            });
        for s in stored.iter().filter(|s| !s.delta) {
            self.blocks
                .insert(s.id, data[s.block * BS..(s.block + 1) * BS].to_vec());
        }
    }
}

/// Sessions of writes (each a new open of the pool, as each `condense import` is), each
/// write its blocks' tags (`None`: zeros), into one volume per session.
fn replay_matches(compression: Compression, sessions: &[Vec<Vec<Option<u64>>>]) -> (u64, u64) {
    let disk = SimDir::new();
    let init = InitOptions {
        compression,
        segment_bytes_target: 1 << 20,
        ..Default::default()
    };
    Pool::init(&SimHandle(disk.clone()), &init).expect("init");
    let pool = open(&disk);
    pool.enable_deltas().expect("enable deltas");
    pool.close().expect("close");
    let mut model = Model {
        replay: DeltaReplay::default(),
        seen: HashSet::new(),
        blocks: HashMap::new(),
        compression,
    };
    for (n, writes) in sessions.iter().enumerate() {
        let pool = open(&disk);
        model.replay.reopen();
        let name = format!("v{n}");
        let blocks: usize = writes.iter().map(Vec::len).sum();
        pool.create_volume(&name, (blocks * BS) as u64)
            .expect("create");
        let h = pool.volume(&name).expect("volume");
        let mut at = 0;
        for (w, tags) in writes.iter().enumerate() {
            let data: Vec<u8> = tags
                .iter()
                .flat_map(|t| t.map_or_else(|| vec![0; BS], block))
                .collect();
            h.write_at((at * BS) as u64, &data, false).expect("write");
            at += tags.len();
            model.write(&data);
            let s = pool.stats().expect("stats");
            let t = model.replay.totals();
            let got = (s.unique_chunks, s.delta.chunks_written, s.stored_bytes);
            assert_eq!(
                got,
                (t.chunks, t.deltas, t.stored_bytes),
                "{name} write {w}: the pool (chunks, deltas, payload bytes) and the replay differ"
            );
            assert_eq!(s.delta.sketch_index_bytes, model.replay.ram_bytes());
        }
        pool.close().expect("close");
    }
    let t = model.replay.totals();
    (t.deltas, t.hits)
}

#[test]
fn the_replay_stores_what_the_delta_pool_stores() {
    let tags = |fams: std::ops::Range<u64>, variant: u64| -> Vec<Option<u64>> {
        fams.map(|f| Some(f * 16 + variant)).collect()
    };
    // a: 200 families (a third noise: runs of it make the compressor skip blocks), each
    // with a near copy a little later in the same write, zeros and duplicates between.
    let mut a: Vec<Option<u64>> = Vec::new();
    for chunk in (0..200u64).collect::<Vec<_>>().chunks(20) {
        a.extend(chunk.iter().map(|&f| Some(f * 16)));
        a.extend(chunk.iter().map(|&f| Some(f * 16 + 1)));
        a.push(None);
        a.push(Some(chunk[0] * 16));
    }
    // Writes of 64 blocks: later writes find the earlier ones' blocks in the sketch index.
    let first: Vec<Vec<Option<u64>>> = a.chunks(64).map(<[_]>::to_vec).collect();
    // b, after a reopen (the index empty again): variants 2 of the same families in writes
    // of 100, then variants 3 in writes of 3, each finding b's earlier blocks.
    let mut second: Vec<Vec<Option<u64>>> =
        tags(0..200, 2).chunks(100).map(<[_]>::to_vec).collect();
    second.extend(tags(0..60, 3).chunks(3).map(<[_]>::to_vec));
    // Families nobody wrote, one block each: no candidate, stored alone; then 256 of noise
    // in a row (the compressor skips some in each run of a write, and the replay must skip
    // the same).
    second.push(tags(500..540, 0));
    let noisy = |i: u64| if i % 32 == 3 { 5000 + i } else { 900 + 3 * i };
    second.push((0..256).map(|i| Some(noisy(i) * 16)).collect());
    for compression in [Compression::Zstd(3), Compression::Lz4] {
        let (deltas, hits) = replay_matches(compression, &[first.clone(), second.clone()]);
        // Both kinds of base were used: earlier blocks of a write, and the sketch index.
        // (200 variants 1 and 60 variants 3; variants 2 follow a reopen, in writes of
        // other families.)
        assert!(deltas >= 250, "{compression:?}: {deltas} deltas");
        assert!(hits >= 60, "{compression:?}: {hits} sketch index hits");
    }
}

//! The cache tier: hits after a second read, after a reopen and after a crash; a corrupt
//! cache entry is detected, counted and read from the segments instead; an entry whose chunk
//! id was reused by another chunk is not served; a scan does not flush a hot set.

use condense_engine::io::Dir;
use condense_engine::sim::{SimDir, SimHandle, SimRng};
use condense_engine::{
    CacheConf, CacheDir, CacheMode, CacheStats, Compression, InitOptions, OpenOptions, Pool,
    WritePolicy,
};
use std::sync::Arc;

const BS: usize = 4096;
/// One slot of a 4 KiB-block pool (the record of a raw block plus slack).
const SLOT: u64 = 4224;

/// Distinct, compressible content for each tag.
fn block(tag: u64) -> Vec<u8> {
    let mut b: Vec<u8> = (0..BS)
        .map(|i| ((i / 16) as u64).wrapping_mul(tag | 1) as u8)
        .collect();
    b[..8].copy_from_slice(&tag.to_le_bytes());
    b
}

struct Disks {
    pool: Arc<SimDir>,
    cache: Arc<SimDir>,
}

fn open(d: &Disks) -> Arc<Pool> {
    open_with(d, None)
}

/// Open with a metadata page cache in RAM of `metadata_cache_bytes` (`None`: the default).
fn open_with(d: &Disks, metadata_cache_bytes: Option<u64>) -> Arc<Pool> {
    let opts = OpenOptions {
        cache_dir: Some(CacheDir(Arc::new(SimHandle(d.cache.clone())))),
        metadata_cache_bytes,
        ..Default::default()
    };
    Pool::open(Arc::new(SimHandle(d.pool.clone())), opts).expect("open")
}

/// A pool with a cache of `slots` slots attached and a volume "a" of `blocks` blocks.
fn setup(slots: u64, blocks: u64) -> (Disks, Arc<Pool>) {
    setup_with(slots, blocks, None)
}

fn setup_with(slots: u64, blocks: u64, metadata_cache_bytes: Option<u64>) -> (Disks, Arc<Pool>) {
    let d = Disks {
        pool: SimDir::new(),
        cache: SimDir::new(),
    };
    let init = InitOptions {
        write_policy: WritePolicy::Async,
        ..Default::default()
    };
    Pool::init(&SimHandle(d.pool.clone()), &init).expect("init");
    let pool = open_with(&d, metadata_cache_bytes);
    pool.attach_cache(
        Arc::new(SimHandle(d.cache.clone())),
        CacheConf {
            path: "sim".into(),
            size_bytes: 4096 + slots * SLOT,
            mode: CacheMode::WriteThrough,
        },
    )
    .expect("attach");
    pool.create_volume("a", blocks * BS as u64).expect("create");
    (d, pool)
}

fn write(pool: &Pool, vol: &str, first_tag: u64, blocks: u64) {
    let h = pool.volume(vol).expect("volume");
    let data: Vec<u8> = (0..blocks).flat_map(|b| block(first_tag + b)).collect();
    h.write_at(0, &data, false).expect("write");
}

/// Read the volume in pieces of 16 blocks, check it, and wait for the promotions.
fn read_check(pool: &Pool, vol: &str, first_tag: u64, blocks: u64) {
    let h = pool.volume(vol).expect("volume");
    for start in (0..blocks).step_by(16) {
        let n = 16.min(blocks - start);
        let mut buf = vec![0u8; n as usize * BS];
        h.read_at(start * BS as u64, &mut buf).expect("read");
        for b in 0..n {
            assert!(
                buf[b as usize * BS..(b as usize + 1) * BS] == block(first_tag + start + b)[..],
                "{vol} block {} reads wrong data",
                start + b
            );
        }
    }
    pool.cache_drain();
}

fn stats(pool: &Pool) -> CacheStats {
    pool.cache_stats().expect("a cache is attached")
}

#[test]
fn second_read_reopen_and_crash_are_served_from_cache() {
    let (d, pool) = setup(256, 64);
    write(&pool, "a", 1000, 64);
    pool.flush().expect("flush");
    read_check(&pool, "a", 1000, 64);
    let s = stats(&pool);
    assert_eq!((s.hits, s.misses), (0, 64));
    assert_eq!(s.promotions, 64);
    // The second pass is served from the cache.
    read_check(&pool, "a", 1000, 64);
    let s = stats(&pool);
    assert_eq!((s.hits, s.misses), (64, 64));
    assert_eq!(s.hit_bytes, 64 * BS as u64);
    assert_eq!(s.used_bytes, 64 * SLOT);

    // A clean close and reopen: warm, and the counters survive.
    pool.close().expect("close");
    drop(pool);
    let pool = open(&d);
    read_check(&pool, "a", 1000, 64);
    let s = stats(&pool);
    assert_eq!((s.hits, s.misses), (128, 64));

    // Dropped without a close (kill -9): still warm.
    drop(pool);
    let pool = open(&d);
    let before = stats(&pool).hits;
    read_check(&pool, "a", 1000, 64);
    assert_eq!(stats(&pool).hits - before, 64);
    drop(pool);

    // Power loss of both devices, with whatever was not synced lost or torn.
    for seed in 0..8 {
        let mut rng = SimRng::new(seed);
        let crashed = Disks {
            pool: d.pool.crash(&mut rng),
            cache: d.cache.crash(&mut rng),
        };
        let pool = open(&crashed);
        let before = stats(&pool).hits;
        read_check(&pool, "a", 1000, 64);
        let s = stats(&pool);
        assert_eq!(s.hits - before, 64, "seed {seed}: {s:?}");
        assert_eq!(s.corrupt, 0, "seed {seed}");
    }
}

#[test]
fn corrupt_entry_is_counted_dropped_and_read_from_the_pool() {
    let (d, pool) = setup(64, 16);
    write(&pool, "a", 7, 16);
    read_check(&pool, "a", 7, 16);
    // One bit in the payload of every slot in use.
    for slot in 0..16 {
        d.cache
            .flip_bit("cache.dat", 4096 + slot * SLOT + 40, 3)
            .expect("flip");
    }
    read_check(&pool, "a", 7, 16);
    let s = stats(&pool);
    assert_eq!(s.corrupt, 16, "{s:?}");
    assert_eq!(s.hits, 0);
    // Re-read from the segments and promoted again: the next pass hits.
    read_check(&pool, "a", 7, 16);
    assert_eq!(stats(&pool).hits, 16);
    // The pool itself was never touched.
    let report = pool.verify(&|_, _| {}).expect("verify");
    assert!(report.is_clean(), "{report:?}");
}

#[test]
fn an_entry_whose_chunk_id_was_reused_is_not_served() {
    let (d, pool) = setup(64, 4);
    pool.flush().expect("flush");
    // Chunk 0 holds tag 1: read (cached), then lost (never flushed; the process dies).
    write(&pool, "a", 1, 1);
    read_check(&pool, "a", 1, 1);
    assert_eq!(stats(&pool).promotions, 1);
    drop(pool);
    let pool = open(&d);
    let mut buf = vec![1u8; BS];
    pool.volume("a")
        .and_then(|h| h.read_at(0, &mut buf))
        .expect("read");
    assert!(buf.iter().all(|&b| b == 0), "the unflushed write was lost");
    // The same chunk id now holds other data: the cached record must not be served.
    write(&pool, "a", 2, 1);
    read_check(&pool, "a", 2, 1);
    read_check(&pool, "a", 2, 1);
    let s = stats(&pool);
    assert_eq!(s.corrupt, 0, "{s:?}");
    assert_eq!(s.hits, 1, "{s:?}");
}

#[test]
fn a_scan_twice_the_cache_leaves_the_hot_set_cached() {
    let slots = 200;
    let (_d, pool) = setup(slots, 100);
    pool.create_volume("scan", 2 * slots * BS as u64)
        .expect("create");
    write(&pool, "a", 1, 100);
    write(&pool, "scan", 100_000, 2 * slots);
    pool.flush().expect("flush");
    // The hot set, read twice: the second pass hits.
    read_check(&pool, "a", 1, 100);
    read_check(&pool, "a", 1, 100);
    assert_eq!(stats(&pool).hits, 100);
    // One sequential scan of twice the cache.
    read_check(&pool, "scan", 100_000, 2 * slots);
    let before = stats(&pool).hits;
    read_check(&pool, "a", 1, 100);
    let hot_hits = stats(&pool).hits - before;
    assert!(
        hot_hits >= 80,
        "only {hot_hits} of 100 hot blocks survived the scan"
    );
}

#[test]
fn detach_and_a_lost_cache_directory_lose_nothing() {
    let (d, pool) = setup(64, 16);
    write(&pool, "a", 5, 16);
    pool.flush().expect("flush");
    read_check(&pool, "a", 5, 16);
    drop(pool);
    // The cache directory is gone (a new, empty device): the pool opens and reads.
    let lost = Disks {
        pool: d.pool.clone(),
        cache: SimDir::new(),
    };
    let pool = open(&lost);
    read_check(&pool, "a", 5, 16);
    read_check(&pool, "a", 5, 16);
    assert_eq!(stats(&pool).hits, 16);
    pool.detach_cache(false).expect("detach");
    assert!(pool.cache_stats().is_none());
    read_check(&pool, "a", 5, 16);
    pool.close().expect("close");
    drop(pool);
    let pool = open(&lost);
    assert!(pool.cache_stats().is_none(), "detach is persistent");
    read_check(&pool, "a", 5, 16);
}

/// Metadata pages faulted in from meta.dat are cached too: with a metadata page cache in RAM
/// of two pages, a reopened pool reads its block-map pages from the cache tier, and a page
/// whose cached bytes are damaged is read from meta.dat instead.
#[test]
fn metadata_pages_are_served_from_the_cache_after_a_reopen() {
    // One block every 509: every block has a block-map leaf of its own.
    let spread = 509u64;
    let blocks = 40u64;
    let (d, pool) = setup_with(2048, blocks * spread, Some(2 * 4096));
    let open_small = |d: &Disks| open_with(d, Some(2 * 4096));
    let h = pool.volume("a").expect("volume");
    for b in 0..blocks {
        h.write_at(b * spread * BS as u64, &block(b + 1), false)
            .expect("write");
    }
    drop(h);
    pool.close().expect("close");
    drop(pool);

    let read_all = |pool: &Pool| {
        let h = pool.volume("a").expect("volume");
        for b in 0..blocks {
            let mut buf = vec![0u8; BS];
            h.read_at(b * spread * BS as u64, &mut buf).expect("read");
            assert!(buf == block(b + 1), "block {b} reads wrong data");
        }
        pool.cache_drain();
    };
    let pool = open_small(&d);
    read_all(&pool);
    let first = pool.cache_stats().expect("stats");
    assert!(
        first.meta_misses >= blocks,
        "page faults went to meta.dat: {first:?}"
    );
    pool.close().expect("close");
    drop(pool);

    let pool = open_small(&d);
    read_all(&pool);
    let second = pool.cache_stats().expect("stats");
    assert!(
        second.meta_hits >= blocks,
        "a reopened pool faults its pages in from the cache: {second:?}"
    );
    pool.close().expect("close");
    drop(pool);

    // Damage every slot: the pages (and chunks) are read from the pool, correctly.
    let len = d.cache.file_len("cache.dat").expect("cache.dat");
    let mut rng = SimRng::new(7);
    for off in (4096..len).step_by(SLOT as usize) {
        d.cache
            .flip_bit("cache.dat", off + rng.below(32), 3)
            .expect("flip");
    }
    let pool = open_small(&d);
    read_all(&pool);
    let third = pool.cache_stats().expect("stats");
    // (A page faulted twice in this pass may hit the fresh entry its first miss wrote.)
    assert!(
        third.meta_misses >= blocks,
        "damaged pages are read from meta.dat: {third:?}"
    );
    assert!(
        third.corrupt > first.corrupt,
        "damage is counted: {third:?}"
    );
}

/// A delta's bases are read as a read's own records are: through the cache tier, and
/// offered to it. So once a volume of deltas was read, its deltas read from the cache alone,
/// even with every base's record in the pool's segments damaged.
#[test]
fn reading_deltas_leaves_their_bases_in_the_cache() {
    const N: usize = 32;
    let noise = |seed: u64| -> Vec<u8> {
        let mut rng = SimRng::new(seed);
        (0..BS).map(|_| rng.next_u64() as u8).collect()
    };
    let base: Vec<Vec<u8>> = (0..N as u64).map(|s| noise(s + 1)).collect();
    let near: Vec<u8> = base
        .iter()
        .enumerate()
        .flat_map(|(b, block)| {
            let mut block = block.clone();
            block[1000..1016].copy_from_slice(&[b as u8; 16]);
            block
        })
        .collect();
    let d = Disks {
        pool: SimDir::new(),
        cache: SimDir::new(),
    };
    let init = InitOptions {
        compression: Compression::Zstd(3),
        segment_bytes_target: 64 << 10,
        ..Default::default()
    };
    Pool::init(&SimHandle(d.pool.clone()), &init).expect("init");
    let pool = open(&d);
    pool.enable_deltas().expect("enable deltas");
    for (name, bytes) in [("base", base.concat()), ("near", near.clone())] {
        pool.create_volume(name, bytes.len() as u64)
            .expect("create");
        let h = pool.volume(name).expect("volume");
        h.write_at(0, &bytes, false).expect("write");
        pool.flush().expect("flush");
    }
    let deltas = pool.stats().expect("stats").delta.chunks_written;
    assert!(deltas >= N as u64 * 9 / 10, "deltas: {deltas}");
    pool.close().expect("close");
    drop(pool);

    let pool = open(&d);
    let conf = CacheConf {
        path: "sim".into(),
        size_bytes: 4096 + 4 * N as u64 * SLOT,
        mode: CacheMode::WriteThrough,
    };
    pool.attach_cache(Arc::new(SimHandle(d.cache.clone())), conf)
        .expect("attach");
    let h = pool.volume("near").expect("volume");
    let mut buf = vec![0u8; near.len()];
    h.read_at(0, &mut buf).expect("first read");
    assert!(buf == near, "the first read reads other data");
    pool.cache_drain();
    let s = stats(&pool);
    assert!(
        s.promotions >= N as u64 + deltas,
        "the deltas and their bases cached: {s:?}"
    );
    // Every base's record damaged where the pool keeps it.
    let dir = SimHandle(d.pool.clone());
    for block in &base {
        let damaged = dir.list("seg-").expect("list").into_iter().any(|name| {
            let f = dir.open(&name, false).expect("open segment");
            let mut seg = vec![0u8; f.len().expect("len") as usize];
            f.read_at(&mut seg, 0).expect("read segment");
            let at = seg.windows(BS).position(|w| w == &block[..]);
            at.map(|at| {
                d.pool
                    .flip_bit(&name, (at + 100) as u64, 3)
                    .expect("damage")
            })
            .is_some()
        });
        assert!(damaged, "a base's record is in no segment");
    }
    h.read_at(0, &mut buf)
        .expect("the second read, from the cache");
    assert!(buf == near, "the second read reads other data");
    let again = stats(&pool);
    assert!(
        again.hits - s.hits >= N as u64 + deltas && again.misses == s.misses,
        "the second read's blocks and bases counted as hits: {again:?}"
    );
}

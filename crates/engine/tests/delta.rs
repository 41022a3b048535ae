//! Delta compression (issue 44, crates/engine/src/pool/delta.rs) through a pool on the
//! simulated directory: similar blocks become deltas, every block reads back exactly, verify
//! is clean (a delta's references on its bases counted), a base outlives the volume that
//! wrote it while a delta names it, a dead delta's GC drops its references, the merge pass
//! leaves deltas alone, a reopen and a crash keep all of it, the root says version 5 (builds
//! without deltas refuse the pool), and damage to a base names every block it breaks.

use condense_engine::format::root::ROOT_VERSION_DELTAS;
use condense_engine::io::Dir;
use condense_engine::sim::{SimDir, SimHandle, SimRng};
use condense_engine::{Compression, InitOptions, OpenOptions, Pool};
use std::collections::BTreeSet;
use std::sync::Arc;

const BS: usize = 4096;
const BLOCKS: usize = 64;

/// Incompressible blocks (stored raw alone), one per index.
fn noise(seed: u64) -> Vec<u8> {
    let mut rng = SimRng::new(seed);
    (0..BS).map(|_| rng.next_u64() as u8).collect()
}

/// The base volume's data, and a near copy: each block with 16 bytes changed.
fn data() -> (Vec<u8>, Vec<u8>) {
    let base: Vec<u8> = (0..BLOCKS as u64).flat_map(noise).collect();
    let mut near = base.clone();
    for b in 0..BLOCKS {
        near[b * BS + 1000..b * BS + 1016].copy_from_slice(&[b as u8; 16]);
    }
    (base, near)
}

fn open(disk: &Arc<SimDir>) -> Arc<Pool> {
    let opts = OpenOptions {
        destage_in_background: false,
        release_in_background: false,
        ..Default::default()
    };
    Pool::open(Arc::new(SimHandle(disk.clone())), opts).expect("open")
}

fn write(pool: &Pool, name: &str, bytes: &[u8]) {
    pool.create_volume(name, bytes.len() as u64)
        .expect("create");
    let h = pool.volume(name).expect("volume");
    h.write_at(0, bytes, false).expect("write");
    pool.flush().expect("flush");
}

fn reads(pool: &Pool, name: &str, bytes: &[u8]) {
    let h = pool.volume(name).expect("volume");
    let mut buf = vec![0u8; bytes.len()];
    h.read_at(0, &mut buf).expect("read");
    for b in 0..bytes.len() / BS {
        assert!(
            buf[b * BS..(b + 1) * BS] == bytes[b * BS..(b + 1) * BS],
            "{name} block {b} reads other data"
        );
    }
}

fn verify_clean(pool: &Pool, when: &str) {
    let r = pool.verify(&|_, _| {}).expect("verify");
    assert!(r.is_clean(), "verify {when}: {r:?}");
    assert!(r.not_checked.is_empty(), "{when}: {:?}", r.not_checked);
}

fn unique(pool: &Pool) -> u64 {
    pool.stats().expect("stats").unique_chunks
}

/// The version in the header of the checkpoint root on `disk`.
fn root_version(disk: &Arc<SimDir>) -> u32 {
    let f = SimHandle(disk.clone())
        .open("checkpoint", false)
        .expect("the checkpoint root");
    let mut v = [0u8; 4];
    f.read_at(&mut v, 8).expect("read the root header");
    u32::from_le_bytes(v)
}

/// A pool on `disk` with delta compression on, holding the base volume and its near copy.
fn delta_pool(disk: &Arc<SimDir>, base: &[u8], near: &[u8]) -> Arc<Pool> {
    let init = InitOptions {
        compression: Compression::Zstd(3),
        segment_bytes_target: 64 << 10,
        ..Default::default()
    };
    Pool::init(&SimHandle(disk.clone()), &init).expect("init");
    let pool = open(disk);
    pool.enable_deltas().expect("enable deltas");
    write(&pool, "base", base);
    write(&pool, "near", near);
    pool
}

/// Flip a byte in the middle of the stored record holding `block` (stored raw: noise).
fn damage_record_of(disk: &Arc<SimDir>, block: &[u8]) {
    let dir = SimHandle(disk.clone());
    for name in dir.list("seg-").expect("list") {
        let f = dir.open(&name, false).expect("open segment");
        let mut seg = vec![0u8; f.len().expect("len") as usize];
        f.read_at(&mut seg, 0).expect("read segment");
        if let Some(at) = seg.windows(block.len()).position(|w| w == block) {
            disk.flip_bit(&name, (at + 100) as u64, 3).expect("damage");
            return;
        }
    }
    panic!("no segment holds the block");
}

#[test]
fn similar_blocks_become_deltas_whose_bases_live_while_named() {
    let (base, near) = data();
    let disk = SimDir::new();
    let pool = delta_pool(&disk, &base, &near);
    assert!(pool.deltas_enabled());
    assert_eq!(
        root_version(&disk),
        ROOT_VERSION_DELTAS,
        "older builds refuse it"
    );
    let s = pool.stats().expect("stats");
    let deltas = s.delta.chunks_since_open;
    assert!(deltas >= BLOCKS as u64 * 9 / 10, "{s:?}");
    assert_eq!(s.delta.chunks_written, deltas);
    assert!(
        s.delta.saved_bytes_since_open >= deltas * 3 * BS as u64 / 4,
        "{s:?}"
    );
    assert!(
        s.delta.sketch_index_bytes > 0 && s.delta.sketch_index_chunks > 0,
        "{s:?}"
    );
    assert!(
        s.index_ram_bytes >= s.delta.sketch_index_bytes,
        "the sketch index counts"
    );
    assert_eq!(unique(&pool), 2 * BLOCKS as u64);
    reads(&pool, "base", &base);
    reads(&pool, "near", &near);
    verify_clean(&pool, "after the writes");

    // Reopen: deltas read (the sketch index is rebuilt from nothing), the mode and the
    // count of deltas made are kept.
    pool.close().expect("close");
    let pool = open(&disk);
    assert!(pool.deltas_enabled());
    assert_eq!(pool.stats().expect("stats").delta.chunks_written, deltas);
    reads(&pool, "near", &near);
    verify_clean(&pool, "after a reopen");

    // The merge pass sorts only the chunks that are not deltas, and changes nothing here.
    let m = pool.merge_duplicates(1 << 20, &|_, _| {}).expect("merge");
    assert_eq!(m.chunks_sorted, 2 * BLOCKS as u64 - deltas, "{m:?}");
    assert_eq!(m.merged, 0);
    reads(&pool, "near", &near);
    verify_clean(&pool, "after the merge pass");

    // The base volume deleted, GC: the bases stay (the deltas name them).
    pool.delete_volume("base").expect("delete");
    pool.gc(0).expect("gc");
    pool.gc(0).expect("gc again");
    assert_eq!(unique(&pool), 2 * BLOCKS as u64, "bases kept while named");
    reads(&pool, "near", &near);
    verify_clean(&pool, "after the base volume's delete and GC");

    // A crash after a flush keeps it all.
    pool.flush().expect("flush");
    let crashed = disk.crash(&mut SimRng::new(44));
    drop(pool);
    let pool = open(&crashed);
    reads(&pool, "near", &near);
    verify_clean(&pool, "after a crash");

    // The deltas overwritten: GC drops them (DropDelta), then their bases.
    let h = pool.volume("near").expect("volume");
    h.write_at(
        0,
        &(0..BLOCKS as u64)
            .flat_map(|s| noise(1000 + s))
            .collect::<Vec<u8>>(),
        false,
    )
    .expect("overwrite");
    pool.flush().expect("flush");
    for _ in 0..3 {
        pool.gc(0).expect("gc");
    }
    verify_clean(&pool, "after the deltas' GC");
    assert_eq!(
        unique(&pool),
        BLOCKS as u64,
        "the deltas and their bases are gone"
    );
    pool.close().expect("close");
    let pool = open(&crashed);
    verify_clean(&pool, "after the last reopen");
}

/// Every block of `names` that fails to read, as (volume, block).
fn unreadable(pool: &Pool, names: &[&str]) -> BTreeSet<(String, u64)> {
    let mut out = BTreeSet::new();
    for name in names {
        let h = pool.volume(name).expect("volume");
        let mut buf = vec![0u8; BS];
        for b in 0..BLOCKS as u64 {
            if h.read_at(b * BS as u64, &mut buf).is_err() {
                out.insert((name.to_string(), b));
            }
        }
    }
    out
}

#[test]
fn damage_to_a_base_names_every_block_it_breaks() {
    let (base, near) = data();
    let disk = SimDir::new();
    let pool = delta_pool(&disk, &base, &near);
    let deltas = pool.stats().expect("stats").delta.chunks_written;
    assert!(deltas >= BLOCKS as u64 * 9 / 10, "{deltas}");
    pool.close().expect("close");
    drop(pool);
    damage_record_of(&disk, &base[7 * BS..8 * BS]);
    let pool = open(&disk);

    // What reads fail: the base's own block and the delta naming it, nothing else.
    let broken = unreadable(&pool, &["base", "near"]);
    assert!(broken.contains(&("base".into(), 7)), "{broken:?}");
    assert!(
        broken.contains(&("near".into(), 7)),
        "the delta on it: {broken:?}"
    );
    assert!(broken.len() <= 4, "only the base's dependents: {broken:?}");

    // Verify names exactly those blocks.
    let r = pool.verify(&|_, _| {}).expect("verify");
    let named: BTreeSet<(String, u64)> = r
        .bad_blocks
        .iter()
        .flat_map(|(v, bs)| bs.iter().map(move |b| (v.clone(), *b)))
        .collect();
    assert_eq!(named, broken, "verify: {r:?}");

    // So does a scrub pass.
    let pass = pool.scrub_pass(0, &|| true, &|_| {}).expect("scrub");
    let named: BTreeSet<(String, u64)> = pass
        .damaged_blocks
        .iter()
        .flat_map(|(v, start, n)| (*start..start + n).map(move |b| (v.clone(), b)))
        .collect();
    assert_eq!(named, broken, "scrub: {pass:?}");

    // With the base's volume deleted, the delta's block is still named (its base is named
    // by no block any more, only by the delta).
    pool.delete_volume("base").expect("delete");
    pool.gc(0).expect("gc");
    let r = pool.verify(&|_, _| {}).expect("verify");
    let near_bad = r.bad_blocks.get("near").cloned().unwrap_or_default();
    assert!(near_bad.contains(&7), "verify after the delete: {r:?}");
    let pass = pool.scrub_pass(0, &|| true, &|_| {}).expect("scrub");
    assert!(
        pass.damaged_blocks
            .iter()
            .any(|(v, s, n)| v == "near" && (*s..s + n).contains(&7)),
        "scrub after the delete: {pass:?}"
    );
}

#[test]
fn similar_blocks_of_one_write_are_deltas_of_each_other() {
    // One write of pairs: each odd block a near copy of the even block before it.
    let (base, near) = data();
    let mut pairs = Vec::with_capacity(2 * base.len());
    for b in 0..BLOCKS {
        pairs.extend_from_slice(&base[b * BS..(b + 1) * BS]);
        pairs.extend_from_slice(&near[b * BS..(b + 1) * BS]);
    }
    let disk = SimDir::new();
    Pool::init(&SimHandle(disk.clone()), &InitOptions::default()).expect("init");
    let pool = open(&disk);
    pool.enable_deltas().expect("enable deltas");
    write(&pool, "pairs", &pairs);
    let deltas = pool.stats().expect("stats").delta.chunks_written;
    assert!(deltas >= BLOCKS as u64 * 9 / 10, "{deltas} deltas");
    reads(&pool, "pairs", &pairs);
    verify_clean(&pool, "after the write");
    // The bases' blocks overwritten: the bases live on for the deltas, and read back.
    let h = pool.volume("pairs").expect("volume");
    for b in 0..BLOCKS as u64 {
        h.write_at(2 * b * BS as u64, &noise(5000 + b), false)
            .expect("overwrite");
    }
    pool.flush().expect("flush");
    pool.gc(0).expect("gc");
    let h = pool.volume("pairs").expect("volume");
    let mut buf = vec![0u8; BS];
    for b in 0..BLOCKS {
        h.read_at((2 * b + 1) as u64 * BS as u64, &mut buf)
            .expect("read");
        assert!(buf[..] == near[b * BS..(b + 1) * BS], "block {}", 2 * b + 1);
    }
    verify_clean(&pool, "after the bases' blocks were overwritten and GC");
    pool.close().expect("close");
    let pool = open(&disk);
    verify_clean(&pool, "after a reopen");
}

//! The seed corpus of the engine's fuzz targets: a small pool made on the simulated disk
//! (volumes, a snapshot and a clone, data of every codec, journal batches after the last
//! checkpoint) gives the plain encodings; the encrypted ones are sealed with the fuzz key by
//! the same encoders the engine uses.

use super::*;
use condense_engine::error::{Error, Result};
use condense_engine::format::{ChunkCodec, Fingerprint};
use condense_engine::page_cache::{decode_page, encode_page, page_ctx, TreeId};
use condense_engine::{Compression, InitOptions, OpenOptions, Pool};
use std::path::Path;

/// Seeds for each target: (target, file name, bytes).
type Seeds = Vec<(&'static str, String, Vec<u8>)>;

pub(super) fn write(out: &Path) -> Result<usize> {
    let mut seeds = Seeds::new();
    let files = small_pool()?;
    let get = |name: &str| {
        files
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, b)| b.clone())
            .ok_or_else(|| Error::corrupt("fuzz seeds", format!("the pool has no {name}")))
    };
    let sb = get(format::SUPERBLOCK_NAME)?;
    let ckpt = get(format::CHECKPOINT_NAME)?;
    let meta = get(format::META_NAME)?;
    let uuid = uuid_at(&sb, 24);
    let crypto = fuzz_crypto(uuid).ok_or_else(|| Error::Invalid("fuzz key".into()))?;

    superblocks(&mut seeds, &sb, uuid)?;
    let root = format::decode_root(&ckpt, &uuid, None)?;
    for (flags, name) in [(0, "plain"), (FIX_CHECKSUMS, "fix")] {
        seeds.push(("checkpoint_root", name.into(), flagged(flags, &ckpt)));
    }
    let sealed_root = format::encode_root(&root, &uuid, Some(&crypto))?;
    seeds.push((
        "checkpoint_root",
        "encrypted".into(),
        flagged(ENCRYPTED, &sealed_root),
    ));
    for (name, bytes) in &files {
        if name.starts_with(format::JOURNAL_PREFIX) && bytes.len() > format::JOURNAL_HEADER_BYTES {
            for (mode, m) in [(0u8, "ro"), (1, "salvage"), (2, "writable")] {
                seeds.push(("journal", format!("{name}-{m}"), flagged(mode << 2, bytes)));
            }
        }
        if name.starts_with(format::SEGMENT_PREFIX) {
            seeds.push(("segment", name.clone(), flagged(0, bytes)));
        }
    }
    seeds.push((
        "journal",
        "encrypted".into(),
        flagged(ENCRYPTED | FIX_CHECKSUMS, &sealed_journal(uuid)?),
    ));
    seeds.push((
        "segment",
        "encrypted".into(),
        flagged(ENCRYPTED, &sealed_segment(&crypto, uuid)?),
    ));
    pages(&mut seeds, &root, &meta)?;
    small_objects(&mut seeds, uuid)?;
    delta_records(&mut seeds)?;

    for (target, name, bytes) in &seeds {
        let dir = out.join(target);
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(dir.display().to_string(), e))?;
        let path = dir.join(name);
        std::fs::write(&path, bytes).map_err(|e| Error::io(path.display().to_string(), e))?;
    }
    Ok(seeds.len())
}

/// Delta payloads as the write path makes them: a near copy of one base, and of two bases'
/// halves (`delta_record`).
fn delta_records(seeds: &mut Seeds) -> Result<()> {
    use condense_engine::reduction::{compress_delta, DeltaPayload};
    let (a, b) = (delta_base_block(3), delta_base_block(9));
    let mut near = a.clone();
    near[100..140].fill(7);
    let mut halves = a[..2048].to_vec();
    halves.extend_from_slice(&b[2048..]);
    let both: Vec<u8> = a.iter().chain(&b).copied().collect();
    for (name, block, bases, dict) in [
        ("one-base", &near, vec![3u64], &a),
        ("two-bases", &halves, vec![3, 9], &both),
    ] {
        let compressed = compress_delta(block, dict, 3)
            .ok_or_else(|| Error::Invalid("zstd refused a delta".into()))?;
        let payload = DeltaPayload {
            bases,
            compressed: &compressed,
        }
        .encode();
        seeds.push(("delta_record", name.into(), payload));
    }
    Ok(())
}

/// A saved dedup index of 1,000 chunks (flags byte 0: its checksums are right as saved).
fn saved_dedup_index() -> Result<Vec<u8>> {
    let mut ix = condense_engine::dedup_index::DedupIndex::default();
    for i in 0..1000u64 {
        let h = blake3::hash(&i.to_le_bytes());
        let mut fp = [0u8; 16];
        fp.copy_from_slice(&h.as_bytes()[..16]);
        ix.insert(&fp, i / 128);
    }
    let dir = SimHandle(SimDir::new());
    let name = format::dedup_index::DEDUP_INDEX_NAME;
    let f = dir.open(name, true).map_err(|e| Error::io("seed", e))?;
    let stamp = format::dedup_index::IndexStamp {
        journal_gen: 3,
        next_seq: 42,
        live_chunks: 1000,
        next_chunk: 1000,
        ..Default::default()
    };
    ix.save(&*f, [5; 16], stamp)?;
    let mut bytes = vec![0u8; f.len().map_err(|e| Error::io("seed", e))? as usize];
    f.read_at(&mut bytes, 0).map_err(|e| Error::io("seed", e))?;
    Ok(flagged(0, &bytes))
}

fn flagged(flags: u8, bytes: &[u8]) -> Vec<u8> {
    let mut v = vec![flags];
    v.extend_from_slice(bytes);
    v
}

/// Bytes that compress well, blocks of noise, zeros and duplicates.
fn test_data() -> Vec<u8> {
    let mut v = Vec::new();
    for i in 0..4u32 {
        for j in 0..512u32 {
            v.extend_from_slice(&(i * 1000 + j / 16).to_le_bytes());
            v.extend_from_slice(b"cond");
        }
    }
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..2 * 4096 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.push(x as u8);
    }
    v.extend_from_slice(&[0u8; 4096]);
    let dup = v[..4096].to_vec();
    v.extend_from_slice(&dup);
    v
}

/// The files of a small pool on the simulated disk, with a journal after its last checkpoint.
fn small_pool() -> Result<Vec<(String, Vec<u8>)>> {
    let disk = SimDir::new();
    let dir = SimHandle(disk.clone());
    Pool::init(
        &dir,
        &InitOptions {
            segment_bytes_target: 1 << 16,
            compression: Compression::Lz4,
            ..Default::default()
        },
    )?;
    let pool = Pool::open(
        Arc::new(dir.clone()),
        OpenOptions {
            reserve_bytes: 0,
            destage_in_background: false,
            ..Default::default()
        },
    )?;
    pool.create_volume("vm", 4 << 30)?;
    pool.create_volume("small", 1 << 20)?;
    let data = test_data();
    let v = pool.volume("vm")?;
    v.write_at(0, &data, false)?;
    v.write_at(3 << 30, &data[..8192], false)?;
    pool.create_snapshot("vm", "s1")?;
    pool.clone_volume("vm@s1", "copy")?;
    pool.meta_put("fs/super", Some(b"CS\x01\x02\0\0\0\0\0\0\0"))?;
    // After the checkpoint: journal batches.
    v.write_at(1 << 20, &data[4096..], false)?;
    pool.volume("small")?.zero_at(0, 8192, true, false)?;
    pool.resize_volume("small", 2 << 20, false)?;
    pool.flush()?;
    let mut out = Vec::new();
    for name in dir.list("").map_err(|e| Error::io("listing", e))? {
        let f = dir
            .open(&name, false)
            .map_err(|e| Error::io(name.clone(), e))?;
        let len = f.len().map_err(|e| Error::io(name.clone(), e))?;
        let mut b = vec![0u8; len as usize];
        f.read_at(&mut b, 0)
            .map_err(|e| Error::io(name.clone(), e))?;
        out.push((name, b));
    }
    drop(v);
    pool.close()?;
    Ok(out)
}

fn superblocks(seeds: &mut Seeds, plain: &[u8], uuid: [u8; 16]) -> Result<()> {
    seeds.push(("superblock", "plain".into(), flagged(0, plain)));
    let sb = Superblock::decode(plain)?;
    let user = UserKey::key(FUZZ_USER_KEY);
    let (wrap, _) = crypto::new_data_key(&user, &uuid)?;
    let keyfile = Superblock {
        encryption: Some(wrap.clone()),
        ..sb.clone()
    };
    seeds.push((
        "superblock",
        "keyfile".into(),
        flagged(0, &keyfile.encode()),
    ));
    let passphrase = Superblock {
        encryption: Some(crypto::KeyWrap {
            source: crypto::KeySource::Passphrase {
                m_kib: 65536,
                t: 3,
                p: 1,
                salt: [9; 16],
            },
            ..wrap
        }),
        ..sb
    };
    let bytes = passphrase.encode();
    seeds.push(("superblock", "passphrase".into(), flagged(0, &bytes)));
    seeds.push(("superblock", "fix".into(), flagged(FIX_CHECKSUMS, &bytes)));
    Ok(())
}

/// A journal of an encrypted pool: two sealed batches.
fn sealed_journal(uuid: [u8; 16]) -> Result<Vec<u8>> {
    let dir = SimHandle(SimDir::new());
    let crypto = fuzz_crypto(uuid).map(Arc::new);
    let mut j = Journal::create(&dir, 5, &uuid, 40, crypto)?;
    let loc = Location {
        segment: 1,
        offset: 64,
        stored_len: 1000,
        codec: ChunkCodec::Zstd,
    };
    j.append(&JournalRecord::NewChunk {
        id: 9,
        loc,
        fp: [7; 16],
    });
    j.append(&JournalRecord::MapRun {
        vol: 1,
        start: 100,
        entries: vec![9, format::ENTRY_ZERO, format::ENTRY_UNMAPPED],
    });
    j.seal()?;
    j.append(&JournalRecord::MetaPut {
        key: "fs/dir/1".into(),
        value: Some(b"CD\x01\0\0\0\0".to_vec()),
    });
    j.append(&JournalRecord::Relocate { id: 9, loc });
    j.append(&JournalRecord::DropChunk { id: 9 });
    j.seal()?;
    let f = j.file.clone();
    let len = f.len().map_err(|e| Error::io("journal", e))?;
    let mut b = vec![0u8; len as usize];
    f.read_at(&mut b, 0).map_err(|e| Error::io("journal", e))?;
    Ok(b)
}

/// A segment of an encrypted pool: four records, one per codec (a delta against
/// [`delta_base_block`] 3), payloads sealed.
fn sealed_segment(crypto: &Crypto, uuid: [u8; 16]) -> Result<Vec<u8>> {
    let mut seg = format::encode_segment_header(3, &uuid);
    let data = test_data();
    let codecs = [
        ChunkCodec::Raw,
        ChunkCodec::Lz4,
        ChunkCodec::Zstd,
        ChunkCodec::ZstdDelta,
    ];
    for (i, block) in data.chunks(4096).take(codecs.len()).enumerate() {
        let codec = codecs[i];
        let payload = match codec {
            ChunkCodec::Raw => block.to_vec(),
            ChunkCodec::Lz4 => lz4_flex::block::compress(block),
            ChunkCodec::Zstd => {
                zstd::bulk::compress(block, 3).map_err(|e| Error::io("compressing a seed", e))?
            }
            ChunkCodec::ZstdDelta => {
                let compressed =
                    condense_engine::reduction::compress_delta(block, &delta_base_block(3), 3)
                        .ok_or_else(|| Error::Invalid("zstd refused a delta".into()))?;
                condense_engine::reduction::DeltaPayload {
                    bases: vec![3],
                    compressed: &compressed,
                }
                .encode()
            }
        };
        let fp: Fingerprint = [i as u8 + 1; 16];
        let sealed = crypto.sealed(Kind::Chunk, &format::chunk_ctx(&fp, codec), &payload)?;
        format::encode_record(&mut seg, 100 + i as u64, &fp, codec, &sealed);
    }
    Ok(seg)
}

/// Stored pages of every tree of the pool (roots and a few children), and sealed copies.
fn pages(seeds: &mut Seeds, root: &format::Root, meta: &[u8]) -> Result<()> {
    let crypto = fuzz_crypto([0; 16]).ok_or_else(|| Error::Invalid("fuzz key".into()))?;
    for t in &root.trees {
        let ptr = Ptr {
            page: t.page,
            crc: t.crc,
            units: t.units,
            codec: t.codec,
        };
        let mut todo = vec![(ptr, t.height - 1)];
        let mut n = 0;
        while let Some((p, level)) = todo.pop() {
            if p.page == 0 || n >= 6 {
                continue;
            }
            n += 1;
            let at = (p.page * UNIT as u64) as usize;
            let Some(stored) = meta.get(at..at + usize::from(p.units) * UNIT) else {
                continue;
            };
            let tree: TreeId = t.id;
            let stride = page_cache::stride(tree, level);
            let flags = meta_page_flags(p.codec, tree == CHUNK_TREE, level > 0, false);
            let name = format!("tree{:x}-l{level}-p{}", t.id, p.page);
            seeds.push(("meta_page", name.clone(), flagged(flags, stored)));
            let Some(page) = decode_page(p.codec, stored, stride) else {
                continue;
            };
            let flags = meta_page_flags(p.codec, tree == CHUNK_TREE, level > 0, true);
            // The target reads every interior page as level 1 (the level is in the context).
            let sealed = sealed_page(&crypto, &page, tree, level.min(1))?;
            seeds.push((
                "meta_page",
                format!("{name}-sealed"),
                flagged(flags, &sealed),
            ));
            if level > 0 {
                for i in 0..page_cache::FANOUT as usize {
                    let c = Ptr::read(&page, i);
                    if c.page != 0 {
                        todo.push((c, level - 1));
                    }
                }
            }
        }
    }
    Ok(())
}

/// A page as an encrypted pool stores it (see `PageCache::write_node`): the sealed length,
/// then the sealed stored form, padded to whole units; at unit [`FUZZ_PAGE`].
fn sealed_page(crypto: &Crypto, page: &[u8], tree: TreeId, level: u8) -> Result<Vec<u8>> {
    let (codec, stored) = encode_page(page, page_cache::stride(tree, level));
    let plain_len = if codec == 0 {
        PAGE_BYTES
    } else {
        2 + usize::from(u16::from_le_bytes([stored[0], stored[1]]))
    };
    let mut sealed = vec![0u8; 2];
    let ctx = page_ctx(FUZZ_PAGE, tree, level);
    crypto.seal(Kind::Page, &ctx, &stored[..plain_len], &mut sealed)?;
    let len = (sealed.len() - 2) as u16;
    sealed[..2].copy_from_slice(&len.to_le_bytes());
    sealed.resize(sealed.len().div_ceil(UNIT) * UNIT, 0);
    // The meta_page target takes the codec from the flags: the seed's flags name `codec`.
    let _ = codec;
    Ok(sealed)
}

fn small_objects(seeds: &mut Seeds, uuid: [u8; 16]) -> Result<()> {
    // cache.idx: inserts, a removal, counters.
    let mut body = Vec::new();
    for s in 0..6u32 {
        let fp = [s as u8; 16];
        body.extend_from_slice(&cache_tier::insert_record(
            s,
            u64::from(s) * 3,
            &fp,
            4128,
            0xdead,
        ));
    }
    body.extend_from_slice(&cache_tier::insert_record(
        7,
        1 << 63 | 12,
        &[0; 16],
        192,
        1,
    ));
    body.extend_from_slice(&cache_tier::record(
        cache_tier::KIND_REMOVE,
        &2u32.to_le_bytes(),
    ));
    let counters: Vec<u8> = (1..=7u64).flat_map(|c| c.to_le_bytes()).collect();
    body.extend_from_slice(&cache_tier::record(cache_tier::KIND_COUNTERS, &counters));
    let mut idx = vec![0u8, 4];
    idx.extend_from_slice(&body);
    seeds.push(("cache_index", "log".into(), idx));
    for (name, mode) in [
        ("writethrough", CacheMode::WriteThrough),
        ("writeback", CacheMode::WriteBack),
    ] {
        let conf = CacheConf {
            path: "/var/cache/condense/vm".into(),
            size_bytes: 8 << 30,
            mode,
        };
        seeds.push(("cache_conf", name.into(), conf.encode().into_bytes()));
    }
    seeds.push(("dedup_index", "saved".into(), saved_dedup_index()?));
    let full = RemoteConf {
        url: "s3://bucket/pools/vm".into(),
        endpoint: Some("http://127.0.0.1:3900".into()),
        region: Some("garage".into()),
        credentials: Some("/etc/condense/s3.env".into()),
        durability_to_store: Some(condense_engine::format::Durability::Remote),
        read_only: false,
    };
    let bare = RemoteConf {
        url: "file:///srv/bucket".into(),
        endpoint: None,
        region: None,
        credentials: None,
        durability_to_store: None,
        read_only: true,
    };
    seeds.push(("remote_conf", "s3".into(), full.encode().into_bytes()));
    seeds.push(("remote_conf", "file".into(), bare.encode().into_bytes()));
    let lease = remote::fresh_body("0123456789abcdef");
    seeds.push(("lease", "fresh".into(), lease.encode()));
    let gen = format::bucket::Generation {
        epoch: 3,
        writer: 0x0123_4567_89ab_cdef,
    };
    let mut m = format::bucket::Manifest::default();
    for (name, seq) in [
        ("superblock", 1),
        ("seg-00000001.dat", 4),
        ("meta/00000000", 5),
    ] {
        let obj = format::bucket::gen_object(gen, name, seq);
        m.files.insert(name.to_string(), (obj, 4096));
    }
    m.wal.insert(format::bucket::wal_object(gen, 2));
    seeds.push(("manifest", "three".into(), m.encode()));
    let journal = sealed_journal(uuid)?;
    let wal = remote::encode_wal(&format::journal_name(5), 64, &journal[64..]);
    seeds.push(("wal_object", "journal".into(), wal));
    let wal = remote::encode_wal(&format::segment_name(3), 0, &journal[..100]);
    seeds.push(("wal_object", "segment".into(), wal));
    // Sealed objects of every kind, with their contexts.
    let c = fuzz_crypto([0x33; 16]).ok_or_else(|| Error::Invalid("fuzz key".into()))?;
    for (i, kind) in KINDS.iter().enumerate() {
        let ctx = &b"context-of-the-object"[..4 * i];
        let mut v = vec![i as u8, ctx.len() as u8];
        v.extend_from_slice(ctx);
        c.seal(*kind, ctx, &test_data()[..64 << i], &mut v)?;
        seeds.push(("sealed_object", format!("kind{i}"), v));
    }
    seeds.push(("key_file", "raw".into(), FUZZ_USER_KEY.to_vec()));
    let hex: String = FUZZ_USER_KEY.iter().map(|b| format!("{b:02x}")).collect();
    seeds.push(("key_file", "hex".into(), format!("{hex}\n").into_bytes()));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The seeds decode through their targets' functions (a seed that stops at the first
    /// check would seed nothing), and `FUZZ_SEEDS_OUT=DIR` writes them there (fuzz/seeds).
    #[test]
    fn seeds_are_real_encodings() -> Result<()> {
        let tmp = std::env::temp_dir().join(format!("condense-seeds-{}", std::process::id()));
        let out = std::env::var_os("FUZZ_SEEDS_OUT").map_or(tmp.clone(), Into::into);
        let n = write(&out)?;
        assert!(n > 30, "{n} seeds");
        let files = small_pool()?;
        let (_, sb) = files
            .iter()
            .find(|(n, _)| n == format::SUPERBLOCK_NAME)
            .ok_or_else(|| Error::Invalid("no superblock".into()))?;
        let uuid = uuid_at(sb, 24);
        let ckpt = files
            .iter()
            .find(|(n, _)| n == format::CHECKPOINT_NAME)
            .map(|(_, b)| b.clone())
            .unwrap_or_default();
        let root = format::decode_root(&ckpt, &uuid, None)?;
        assert!(root.volumes.iter().any(|v| v.snapshot_of.is_some()));
        assert!(files
            .iter()
            .any(|(n, b)| n.starts_with("journal-") && b.len() > 64));
        for entry in std::fs::read_dir(&out).map_err(|e| Error::io("seeds", e))? {
            let entry = entry.map_err(|e| Error::io("seeds", e))?;
            let target = entry.file_name().to_string_lossy().into_owned();
            let f: fn(&[u8]) -> bool = match target.as_str() {
                "superblock" => superblock,
                "checkpoint_root" => checkpoint_root,
                "journal" => journal,
                "meta_page" => meta_page,
                "segment" => segment,
                "cache_index" => cache_index,
                "cache_conf" => cache_conf,
                "dedup_index" => dedup_index,
                "remote_conf" => remote_conf,
                "lease" => lease,
                "manifest" => manifest,
                "wal_object" => wal_object,
                "sealed_object" => sealed_object,
                "key_file" => key_file,
                "delta_record" => delta_record,
                _ => continue,
            };
            for seed in std::fs::read_dir(entry.path()).map_err(|e| Error::io("seeds", e))? {
                let path = seed.map_err(|e| Error::io("seeds", e))?.path();
                let bytes = std::fs::read(&path).map_err(|e| Error::io("seed", e))?;
                assert!(f(&bytes), "seed {} does not decode", path.display());
            }
        }
        if out == tmp {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        Ok(())
    }
}

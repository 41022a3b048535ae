//! Encryption at rest, through the engine's API on a real directory: data round-trips across
//! reopen, GC and checkpoints; no plaintext reaches any file (and the same check finds it in
//! an unencrypted pool); a missing or wrong key opens nothing and changes no file; changed
//! bytes are authentication errors naming the volume and block (data) or meta.dat offset
//! (metadata); a copied pool written in both copies never seals two chunks under one nonce,
//! no open writes the superblock, and a superblock edited without the key does not open.

use condense_engine::{Error, InitOptions, OpenOptions, Pool, UserKey};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

type R<T = ()> = Result<T, Box<dyn std::error::Error>>;

const KEY: [u8; 32] = [0x42; 32];
const MARK: &[u8] = b"CONDENSE-KNOWN-PLAINTEXT-";

/// 1 MiB: a compressible run of a marker, then blocks of pseudo-random bytes with the marker
/// at the start of each (incompressible).
fn pattern() -> Vec<u8> {
    let mut v = Vec::with_capacity(1 << 20);
    while v.len() < 512 << 10 {
        v.extend_from_slice(MARK);
        v.extend_from_slice(format!("{:08}", v.len()).as_bytes());
    }
    v.truncate(512 << 10);
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    while v.len() < 1 << 20 {
        if v.len() % 4096 == 0 {
            v.extend_from_slice(MARK);
        }
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.push(x as u8);
    }
    v
}

fn init(dir: &Path, key: Option<UserKey>) -> R {
    Pool::init_path(
        dir,
        &InitOptions {
            segment_bytes_target: 1 << 20,
            encryption: key,
            ..Default::default()
        },
    )?;
    Ok(())
}

fn open(dir: &Path, key: Option<UserKey>, read_only: bool) -> Result<Arc<Pool>, Error> {
    Pool::open_path(
        dir,
        OpenOptions {
            key,
            read_only,
            ..Default::default()
        },
    )
}

fn files(dir: &Path) -> R<BTreeMap<String, Vec<u8>>> {
    let mut m = BTreeMap::new();
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        m.insert(
            e.file_name().to_string_lossy().into_owned(),
            std::fs::read(e.path())?,
        );
    }
    Ok(m)
}

/// Files of the pool that contain `needle`.
fn holding(dir: &Path, needle: &[u8]) -> R<Vec<String>> {
    Ok(files(dir)?
        .into_iter()
        .filter(|(_, b)| b.windows(needle.len()).any(|w| w == needle))
        .map(|(n, _)| n)
        .collect())
}

fn key() -> Option<UserKey> {
    Some(UserKey::key(KEY))
}

/// Write the pattern to volume "secret" (twice: 0 and 1 MiB) and a volume name that is itself
/// a marker, then delete a copy and GC so relocated records and a later checkpoint are covered.
fn fill(pool: &Pool) -> R {
    let data = pattern();
    pool.create_volume("secret", 4 << 20)?;
    pool.create_volume("CONDENSE-KNOWN-PLAINTEXT-name", 1 << 20)?;
    let v = pool.volume("secret")?;
    v.write_at(0, &data, false)?;
    v.write_at(1 << 20, &data, false)?;
    pool.flush()?;
    pool.create_volume("junk", 4 << 20)?;
    pool.volume("junk")?
        .write_at(0, &data[..4096 * 64], false)?;
    pool.delete_volume("junk")?;
    pool.gc(1)?;
    Ok(())
}

#[test]
fn known_plaintext_is_nowhere_in_an_encrypted_pool() -> R {
    let t = tempfile::tempdir()?;
    let (enc, plain) = (t.path().join("enc"), t.path().join("plain"));
    init(&enc, key())?;
    init(&plain, None)?;
    for (dir, k) in [(&enc, key()), (&plain, None)] {
        let pool = open(dir, k, false)?;
        fill(&pool)?;
        // Journal only (not yet checkpointed): a write after the GC checkpoint.
        pool.volume("secret")?
            .write_at(2 << 20, &pattern(), false)?;
        pool.flush()?;
        let found = holding(dir, MARK)?;
        if dir == &plain {
            assert!(
                !found.is_empty(),
                "the check must find plaintext in a plain pool"
            );
        } else {
            assert!(found.is_empty(), "plaintext in {found:?}");
        }
        pool.close()?;
        let found = holding(dir, MARK)?;
        assert_eq!(found.is_empty(), dir == &enc, "after close: {found:?}");
    }
    // Reopen and read everything back.
    let pool = open(&enc, key(), false)?;
    let mut buf = vec![0u8; 1 << 20];
    for at in [0u64, 1 << 20, 2 << 20] {
        pool.volume("secret")?.read_at(at, &mut buf)?;
        assert!(buf == pattern(), "content at {at}");
    }
    let report = pool.verify(&|_, _| {})?;
    assert!(report.bad_chunks.is_empty() && report.metadata_problems.is_empty());
    // Dedup stays exact: three copies of the pattern are one copy's chunks.
    let s = pool.stats()?;
    assert_eq!(s.unique_chunks, 256, "unique chunks {}", s.unique_chunks);
    // The fingerprint key is not in the superblock.
    let sb = std::fs::read(enc.join("superblock"))?;
    assert_eq!(sb.len(), 256);
    assert!(sb[40..72].iter().all(|&b| b == 0));
    Ok(())
}

#[test]
fn missing_or_wrong_key_opens_nothing_and_changes_nothing() -> R {
    let t = tempfile::tempdir()?;
    let dir = t.path().join("p");
    init(&dir, key())?;
    let pool = open(&dir, key(), false)?;
    fill(&pool)?;
    pool.close()?;
    drop(pool);
    let before = files(&dir)?;
    let missing = open(&dir, None, false).err();
    assert!(
        matches!(&missing, Some(Error::KeyRequired(_))),
        "{missing:?}"
    );
    assert!(missing
        .map(|e| e.to_string())
        .is_some_and(|m| m.contains("is encrypted") && m.contains("--key-file")));
    let wrong = open(&dir, Some(UserKey::key([1; 32])), false).err();
    assert!(
        wrong
            .as_ref()
            .is_some_and(|e| e.to_string().contains("the key does not open pool")),
        "{wrong:?}"
    );
    let kind = open(&dir, Some(UserKey::passphrase(b"x")), false).err();
    assert!(matches!(kind, Some(Error::WrongKey(_))), "{kind:?}");
    assert_eq!(files(&dir)?, before, "a failed open changed the pool");
    // A read-only open with the key reads and writes nothing either.
    let ro = open(&dir, key(), true)?;
    let mut buf = vec![0u8; 1 << 20];
    ro.volume("secret")?.read_at(0, &mut buf)?;
    assert!(buf == pattern());
    drop(ro);
    assert_eq!(files(&dir)?, before, "a read-only open changed the pool");
    Ok(())
}

#[test]
fn a_key_given_to_a_plain_pool_opens_nothing_and_changes_nothing() -> R {
    let t = tempfile::tempdir()?;
    let dir = t.path().join("p");
    init(&dir, None)?;
    let pool = open(&dir, None, false)?;
    fill(&pool)?;
    pool.close()?;
    drop(pool);
    let before = files(&dir)?;
    for (k, read_only) in [
        (key(), false),
        (key(), true),
        (
            Some(UserKey::passphrase(b"correct horse battery staple")),
            false,
        ),
    ] {
        let refused = open(&dir, k, read_only).err();
        assert!(
            matches!(&refused, Some(Error::NotEncrypted(_))),
            "{refused:?}"
        );
        assert!(refused
            .map(|e| e.to_string())
            .is_some_and(|m| m.contains("is not encrypted, yet a key was given")));
    }
    assert_eq!(files(&dir)?, before, "a refused open changed the pool");
    // Without a key it opens as before.
    drop(open(&dir, None, true)?);
    Ok(())
}

#[test]
fn a_refused_init_leaves_nothing_behind() -> R {
    let t = tempfile::tempdir()?;
    let dir = t.path().join("p");
    let short = init(&dir, Some(UserKey::passphrase(b"short")));
    assert!(short.is_err(), "a 5-character passphrase made a pool");
    assert!(
        !dir.exists(),
        "a refused init left {} behind",
        dir.display()
    );
    // In a directory that was there already (empty): it stays, and stays empty.
    std::fs::create_dir(&dir)?;
    assert!(init(&dir, Some(UserKey::passphrase(b"short"))).is_err());
    assert!(
        std::fs::read_dir(&dir)?.next().is_none(),
        "a refused init left files in {}",
        dir.display()
    );
    Ok(())
}

#[test]
fn passphrase_pool_opens_with_its_passphrase_only() -> R {
    let t = tempfile::tempdir()?;
    let dir = t.path().join("p");
    init(
        &dir,
        Some(UserKey::passphrase(b"correct horse battery staple")),
    )?;
    let pool = open(
        &dir,
        Some(UserKey::passphrase(b"correct horse battery staple")),
        false,
    )?;
    pool.create_volume("v", 1 << 20)?;
    pool.volume("v")?.write_at(0, &pattern(), false)?;
    pool.close()?;
    drop(pool);
    let bad = open(&dir, Some(UserKey::passphrase(b"wrong horse")), false).err();
    assert!(matches!(bad, Some(Error::WrongKey(_))), "{bad:?}");
    let bad = open(&dir, key(), false).err();
    assert!(matches!(bad, Some(Error::WrongKey(_))), "{bad:?}");
    let pool = open(
        &dir,
        Some(UserKey::passphrase(b"correct horse battery staple")),
        false,
    )?;
    let mut buf = vec![0u8; 1 << 20];
    pool.volume("v")?.read_at(0, &mut buf)?;
    assert!(buf == pattern());
    Ok(())
}

/// The nonce (session salt and counter) and sealed payload of every chunk record in the
/// segments of `dir` (docs/FORMAT.md: a 64-byte segment header, then 32-byte record headers
/// whose word at 24 holds the payload length in bits 0-23).
fn chunk_nonces(dir: &Path) -> R<Vec<(Vec<u8>, Vec<u8>)>> {
    let mut out = Vec::new();
    for (name, b) in files(dir)? {
        if !name.starts_with("seg-") {
            continue;
        }
        let mut at = 64;
        while at + 32 <= b.len() {
            let word = u32::from_le_bytes([b[at + 24], b[at + 25], b[at + 26], b[at + 27]]);
            let len = (word & 0xff_ffff) as usize;
            if len == 0 || at + 32 + len > b.len() {
                break;
            }
            let payload = &b[at + 32..at + 32 + len];
            out.push((payload[..24].to_vec(), payload.to_vec()));
            at += 32 + len;
        }
    }
    Ok(out)
}

fn copy_dir(from: &Path, to: &Path) -> R {
    std::fs::create_dir_all(to)?;
    for e in std::fs::read_dir(from)? {
        let e = e?;
        std::fs::copy(e.path(), to.join(e.file_name()))?;
    }
    Ok(())
}

/// Write 256 blocks of distinct data derived from `seed` into volume "v" at block 256.
fn write_distinct(pool: &Pool, seed: u8) -> R {
    let mut data = vec![0u8; 256 * 4096];
    for (i, b) in data.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(31) ^ seed ^ (i / 4096) as u8;
    }
    pool.volume("v")?.write_at(256 * 4096, &data, false)?;
    pool.flush()?;
    Ok(())
}

#[test]
fn a_copied_pool_written_in_both_copies_never_reuses_a_nonce() -> R {
    let t = tempfile::tempdir()?;
    let (a, b) = (t.path().join("a"), t.path().join("b"));
    init(&a, key())?;
    let superblock = std::fs::read(a.join("superblock"))?;
    let pool = open(&a, key(), false)?;
    pool.create_volume("v", 4 << 20)?;
    pool.volume("v")?.write_at(0, &pattern(), false)?;
    pool.close()?;
    drop(pool);
    copy_dir(&a, &b)?;
    for (dir, seed) in [(&a, 1u8), (&b, 2u8), (&a, 3u8)] {
        let pool = open(dir, key(), false)?;
        write_distinct(&pool, seed)?;
        pool.close()?;
    }
    drop(open(&b, key(), true)?);
    for dir in [&a, &b] {
        assert!(
            std::fs::read(dir.join("superblock"))? == superblock,
            "no open wrote the superblock"
        );
    }
    let mut seen: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
    let mut records = 0;
    for dir in [&a, &b] {
        for (nonce, sealed) in chunk_nonces(dir)? {
            records += 1;
            if let Some(earlier) = seen.insert(nonce.clone(), sealed.clone()) {
                assert!(
                    earlier == sealed,
                    "nonce {nonce:02x?} sealed two different payloads"
                );
            }
        }
    }
    assert!(
        records > 500,
        "read {records} records: the parser found the chunks"
    );
    Ok(())
}

/// Rewrite both CRCs of a superblock after an edit, as someone without the key would.
fn fix_crcs(b: &mut [u8]) {
    let c = crc32c::crc32c(&b[..124]);
    b[124..128].copy_from_slice(&c.to_le_bytes());
    let c = crc32c::crc32c(&b[..252]);
    b[252..256].copy_from_slice(&c.to_le_bytes());
}

#[test]
fn a_superblock_edited_without_the_key_does_not_open() -> R {
    let t = tempfile::tempdir()?;
    let dir = t.path().join("p");
    init(&dir, key())?;
    let pool = open(&dir, key(), true)?; // creates the lock file
    let fields = |p: &Pool| {
        let sb = p.superblock();
        format!("{:?} {:?}", sb.compression, sb.write_policy)
    };
    let want = fields(&pool);
    drop(pool);
    let good = std::fs::read(dir.join("superblock"))?;
    // Write policy sync -> async, compression lz4 -> none, the old epoch field: each with the
    // CRCs fixed, so only the MAC can tell.
    for (at, value) in [(18usize, 2u8), (16, 0), (132, 7)] {
        let mut b = good.clone();
        b[at] = value;
        fix_crcs(&mut b);
        // One copy edited: the other, authentic, is used, and the open says so.
        std::fs::write(dir.join("superblock"), &b)?;
        std::fs::write(dir.join("superblock.copy"), &good)?;
        let pool = open(&dir, key(), true)?;
        assert!(
            pool.replay_report()
                .notes
                .iter()
                .any(|n| n.contains("superblock is damaged") && n.contains("superblock.copy")),
            "byte {at}: {:?}",
            pool.replay_report().notes
        );
        assert_eq!(fields(&pool), want, "byte {at}: the copy's fields");
        drop(pool);
        // Both copies edited: refused.
        std::fs::write(dir.join("superblock.copy"), &b)?;
        let before = files(&dir)?;
        let err = open(&dir, key(), false).err().map(|e| e.to_string());
        assert!(
            err.as_deref()
                .is_some_and(|e| e.contains("superblock") && e.contains("changed without the key")),
            "byte {at}: {err:?}"
        );
        assert!(open(&dir, key(), true).is_err(), "byte {at}: read-only too");
        assert!(files(&dir)? == before, "a refused open changes no file");
    }
    std::fs::write(dir.join("superblock"), &good)?;
    std::fs::write(dir.join("superblock.copy"), &good)?;
    drop(open(&dir, key(), false)?);
    Ok(())
}

/// Flip one bit of the byte at `offset` of a file.
fn flip(path: &Path, offset: usize) -> R {
    let mut b = std::fs::read(path)?;
    b[offset] ^= 0x10;
    std::fs::write(path, b)?;
    Ok(())
}

#[test]
fn a_changed_byte_in_a_segment_is_an_authentication_error_naming_volume_and_block() -> R {
    let t = tempfile::tempdir()?;
    let dir = t.path().join("p");
    init(&dir, key())?;
    let pool = open(&dir, key(), false)?;
    pool.create_volume("vm", 1 << 20)?;
    // One incompressible block at block 5 only, so the segment holds one record.
    let block: Vec<u8> = pattern()[(1 << 20) - 4096..].to_vec();
    pool.volume("vm")?.write_at(5 * 4096, &block, false)?;
    pool.close()?;
    drop(pool);
    // Segment header 64 bytes, record header 32, then the sealed payload.
    flip(&dir.join("seg-00000000.dat"), 64 + 32 + 1000)?;
    let pool = open(&dir, key(), false)?;
    let mut buf = vec![0u8; 1 << 20];
    let err = pool.volume("vm")?.read_at(0, &mut buf).err();
    let msg = err.as_ref().map(|e| e.to_string()).unwrap_or_default();
    assert!(
        matches!(err, Some(Error::Auth { .. })),
        "expected an authentication error, got {err:?}"
    );
    assert!(
        msg.contains("authentication failed") && msg.contains("\"vm\"") && msg.contains("block 5"),
        "{msg}"
    );
    let report = pool.verify(&|_, _| {})?;
    assert_eq!(report.bad_blocks.get("vm"), Some(&vec![5]), "{report:?}");
    assert!(
        report.bad_chunks[0].1.contains("authentication failed"),
        "{report:?}"
    );
    // Other blocks still read.
    pool.volume("vm")?.read_at(0, &mut buf[..4096])?;
    Ok(())
}

#[test]
fn a_changed_metadata_page_is_an_error_naming_its_offset() -> R {
    let t = tempfile::tempdir()?;
    let dir = t.path().join("p");
    init(&dir, key())?;
    let pool = open(&dir, key(), false)?;
    pool.create_volume("vm", 1 << 20)?;
    pool.volume("vm")?.write_at(0, &pattern(), false)?;
    pool.close()?;
    drop(pool);
    // Every page after the 4 KiB header: flip a byte in the first one.
    flip(&dir.join("meta.dat"), 4096 + 20)?;
    let pool = open(&dir, key(), false)?;
    let mut buf = vec![0u8; 1 << 20];
    let err = pool.volume("vm")?.read_at(0, &mut buf).err();
    let msg = err.as_ref().map(|e| e.to_string()).unwrap_or_default();
    assert!(matches!(err, Some(Error::Auth { .. })), "{err:?}");
    assert!(
        msg.contains("meta.dat") && msg.contains("byte 4096"),
        "{msg}"
    );
    Ok(())
}

#[test]
fn a_changed_journal_batch_or_root_fails_the_open() -> R {
    let t = tempfile::tempdir()?;
    let dir = t.path().join("p");
    init(&dir, key())?;
    let pool = open(&dir, key(), false)?;
    pool.create_volume("vm", 1 << 20)?;
    pool.close()?;
    drop(pool);
    // The root: its body (after the 64-byte header) is sealed; its CRC is checked first.
    // Both copies of it changed (one alone is damage the other copy covers: tests/copies.rs).
    let mut root = std::fs::read(dir.join("checkpoint"))?;
    root[70] ^= 1;
    std::fs::write(dir.join("checkpoint.bad"), &root)?;
    let saved = std::fs::read(dir.join("checkpoint"))?;
    std::fs::rename(dir.join("checkpoint.bad"), dir.join("checkpoint"))?;
    std::fs::write(dir.join("checkpoint.copy"), &root)?;
    assert!(open(&dir, key(), false).is_err());
    std::fs::write(dir.join("checkpoint"), &saved)?;
    std::fs::write(dir.join("checkpoint.copy"), saved)?;
    let pool = open(&dir, key(), false)?;
    pool.volume("vm")?.write_at(0, &pattern(), false)?;
    pool.flush()?;
    // A crash (no close): a copy of the directory now, with the batches in its journal.
    let crashed = t.path().join("crashed");
    std::fs::create_dir(&crashed)?;
    for (name, bytes) in files(&dir)? {
        std::fs::write(crashed.join(name), bytes)?;
    }
    drop(pool);
    // Change a payload byte and fix the batch CRC, so only the tag can tell.
    let wal = std::fs::read_dir(&crashed)?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "wal"))
        .ok_or("no journal")?;
    let mut j = std::fs::read(&wal)?;
    let pos = 64; // the first batch
    let len = u32::from_le_bytes([j[pos + 4], j[pos + 5], j[pos + 6], j[pos + 7]]) as usize;
    assert!(len > 28, "the crashed copy's journal holds a batch");
    j[pos + 24 + len / 2] ^= 1;
    let mut h = j[pos..pos + 16].to_vec();
    h.extend_from_slice(&j[pos + 20..pos + 24]);
    h.extend_from_slice(&j[pos + 24..pos + 24 + len]);
    let c = crc32c::crc32c(&h);
    j[pos + 16..pos + 20].copy_from_slice(&c.to_le_bytes());
    std::fs::write(&wal, j)?;
    let err = open(&crashed, key(), false).err();
    let msg = err.as_ref().map(|e| e.to_string()).unwrap_or_default();
    assert!(matches!(err, Some(Error::Auth { .. })), "{err:?}");
    assert!(msg.contains("journal") && msg.contains("batch"), "{msg}");
    Ok(())
}

/// A pool made by the release before session nonces (superblock format 3), frozen in
/// tests/fixtures/format3-pool by `condense init --encrypt` with the key below, `import` of 16
/// blocks "format 3 block NNNN " padded with dots as volume "old", `volume create empty --size
/// 1M`, and one block "format 3 journal block " padded with '#' written at 8 KiB of "empty" by
/// qemu-io through `serve`, which was then killed (so the journal holds a sealed batch).
#[test]
fn a_format_3_pool_opens_read_only_reads_back_and_refuses_writes() -> R {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/format3-pool");
    let t = tempfile::tempdir()?;
    let dir = t.path().join("old");
    copy_dir(&fixture, &dir)?;
    let mut k = [0u8; 32];
    for (i, b) in k.iter_mut().enumerate() {
        *b = [0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef][i % 8];
    }
    let key = || Some(UserKey::key(k));
    let before = files(&dir)?;
    let err = open(&dir, key(), false).err().map(|e| e.to_string());
    assert!(
        err.as_deref()
            .is_some_and(|e| e.contains("format 3") && e.contains("export")),
        "{err:?}"
    );
    let pool = open(&dir, key(), true)?;
    let mut old = vec![0u8; 16 * 4096];
    pool.volume("old")?.read_at(0, &mut old)?;
    for (i, block) in old.chunks(4096).enumerate() {
        let head = format!("format 3 block {i:04} ");
        assert!(block.starts_with(head.as_bytes()), "block {i}");
        assert!(block[head.len()..].iter().all(|&b| b == b'.'), "block {i}");
    }
    let mut j = vec![0u8; 4096];
    pool.volume("empty")?.read_at(8192, &mut j)?;
    let head = b"format 3 journal block ";
    assert!(j.starts_with(head) && j[head.len()..].iter().all(|&b| b == b'#'));
    assert!(matches!(
        pool.create_volume("new", 1 << 20),
        Err(Error::ReadOnly)
    ));
    pool.close()?;
    drop(pool);
    let mut after = files(&dir)?;
    after.remove("lock");
    assert!(after == before, "nothing written to a format 3 pool");
    Ok(())
}

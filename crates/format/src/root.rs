//! The checkpoint root (`checkpoint`, `checkpoint.copy`): a 64-byte header and one
//! zstd-compressed body holding the small state that names everything else (volume list,
//! tree roots, counters, the page bitmap, metadata records, the snapshot extension);
//! docs/FORMAT.md "Checkpoint root".
//!
//! Invariants: the header's CRC is checked before any field is used, the body's before it
//! is opened (encrypted) or decompressed; the body's length is never allocated from the
//! header; counts read from the body are bounded by what the body holds.

use super::common::{
    check_crc, check_magic, check_version, crc, put_u16, put_u32, put_u64, Reader,
    CHECKPOINT_MAGIC, CHECKPOINT_NAME, FORMAT_VERSION,
};
use crate::crypto::{Crypto, Kind};
use crate::error::{Error, Result};

pub const ROOT_HEADER_BYTES: usize = 64;

/// One volume as recorded in a checkpoint root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RootVolume {
    pub id: u32,
    pub size: u64,
    pub data_blocks: u64,
    pub zero_blocks: u64,
    pub name: String,
    /// For a snapshot: the id of the volume it was taken of (in the snapshot extension).
    pub snapshot_of: Option<u32>,
    /// Seconds since the Unix epoch when it was made; 0 if not known (in the extension).
    pub created: u64,
}

/// One paged tree: which (volume id, or u64::MAX for the chunk table), its height, and the
/// pointer to its root page (first 64-byte unit, CRC, units, codec).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RootTree {
    pub id: u64,
    pub height: u8,
    pub page: u64,
    pub crc: u32,
    pub units: u16,
    pub codec: u8,
}

/// The first tree id of a deleted volume's map being released in steps: volume trees are
/// below 2^32, the chunk table is `u64::MAX`.
pub const RELEASE_TREE_FIRST: u64 = 1 << 32;

/// A deleted volume's map still being released (docs/FORMAT.md "Background release"): tree
/// `tree` (in [`Root::trees`]) holds what is left of it; leaves below `next` are released.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RootRelease {
    pub tree: u64,
    /// The volume's name when it was deleted (for `stats`).
    pub name: String,
    /// Leaves the volume's size spanned (the progress shown: the release is over when its
    /// last step removes the tree).
    pub end: u64,
    pub next: u64,
    /// Data blocks the volume held when it was deleted.
    pub data_blocks: u64,
}

/// The root header's version while a release is pending: builds that do not know the
/// release section refuse the pool instead of reading a tree without a volume as garbage.
pub const ROOT_VERSION_RELEASING: u32 = 3;
/// The root header's version once the merge pass may have made forwards (chunk-table slots
/// naming another chunk, docs/FORMAT.md "Forwards"): builds that do not know forwards refuse
/// the pool instead of reading a forward as a chunk. It covers a pending release too.
pub const ROOT_VERSION_FORWARDS: u32 = 4;
/// The root header's version once delta compression is on (chunk records that need other
/// chunks' blocks to decode, docs/FORMAT.md "Delta records"): builds that do not know deltas
/// (version 4 and before) refuse the pool instead of reading a delta as a chunk. It covers
/// forwards and a pending release too.
pub const ROOT_VERSION_DELTAS: u32 = 5;

/// Everything a checkpoint root holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Root {
    pub journal_gen: u64,
    pub next_seq: u64,
    pub next_vol: u32,
    pub volumes: Vec<RootVolume>,
    pub trees: Vec<RootTree>,
    pub next_chunk: u64,
    pub live_chunks: u64,
    pub live_stored_bytes: u64,
    /// (segment, live record bytes)
    pub segment_live: Vec<(u32, u64)>,
    /// Metadata page bytes written over the pool's life (checkpoints and eviction).
    pub meta_bytes_written: u64,
    pub checkpoints: u64,
    /// One bit per page of `meta.dat`: referenced by this root.
    pub bitmap: Vec<u64>,
    pub meta: Vec<(String, Vec<u8>)>,
    /// Pages of `meta.dat` named by more than one parent, with their number of parents
    /// (in the snapshot extension).
    pub shared_pages: Vec<(u64, u32)>,
    /// Deleted volumes' maps still being released (the release section; the header's version
    /// is then [`ROOT_VERSION_RELEASING`]).
    pub releasing: Vec<RootRelease>,
    /// Forwards made over the pool's life, present (the forward section; the header's
    /// version is then [`ROOT_VERSION_FORWARDS`]) from the checkpoint before the merge pass
    /// first journals one, and for good: a pool that may hold forwards stays closed to builds
    /// that do not know them.
    pub forwards: Option<u64>,
    /// Delta records made over the pool's life, present (the delta section; the header's
    /// version is then [`ROOT_VERSION_DELTAS`]) from the checkpoint before the first delta
    /// is journaled, and for good, as `forwards`.
    pub deltas: Option<u64>,
}

/// Tag and version of the snapshot extension at the end of a root body.
pub const ROOT_SNAPSHOT_EXT_MAGIC: u32 = u32::from_le_bytes(*b"SNAP");
pub const ROOT_SNAPSHOT_EXT_VERSION: u32 = 1;
/// Tag and version of the release section, after the snapshot extension if any.
pub const ROOT_RELEASE_EXT_MAGIC: u32 = u32::from_le_bytes(*b"RELS");
pub const ROOT_RELEASE_EXT_VERSION: u32 = 1;
/// Tag and version of the forward section, after the release section if any.
pub const ROOT_FORWARD_EXT_MAGIC: u32 = u32::from_le_bytes(*b"FWDS");
pub const ROOT_FORWARD_EXT_VERSION: u32 = 1;
/// Tag and version of the delta section, after the forward section if any.
pub const ROOT_DELTA_EXT_MAGIC: u32 = u32::from_le_bytes(*b"DLTA");
pub const ROOT_DELTA_EXT_VERSION: u32 = 1;

/// The associated data of a sealed root body: what the header says about it.
fn root_ctx(raw_len: u32, journal_gen: u64, next_seq: u64) -> [u8; 20] {
    let mut c = [0u8; 20];
    c[..4].copy_from_slice(&raw_len.to_le_bytes());
    c[4..12].copy_from_slice(&journal_gen.to_le_bytes());
    c[12..].copy_from_slice(&next_seq.to_le_bytes());
    c
}

/// Encode a checkpoint root; in an encrypted pool (`crypto`) its body is sealed.
pub fn encode_root(root: &Root, uuid: &[u8; 16], crypto: Option<&Crypto>) -> Result<Vec<u8>> {
    let mut b = Vec::new();
    put_u32(&mut b, root.next_vol);
    put_u32(&mut b, root.volumes.len() as u32);
    for v in &root.volumes {
        put_u32(&mut b, v.id);
        put_u64(&mut b, v.size);
        put_u64(&mut b, v.data_blocks);
        put_u64(&mut b, v.zero_blocks);
        put_u16(&mut b, v.name.len() as u16);
        b.extend_from_slice(v.name.as_bytes());
    }
    put_u32(&mut b, root.trees.len() as u32);
    for t in &root.trees {
        put_u64(&mut b, t.id);
        b.push(t.height);
        put_u64(&mut b, t.page);
        put_u32(&mut b, t.crc);
        put_u16(&mut b, t.units);
        b.push(t.codec);
    }
    put_u64(&mut b, root.next_chunk);
    put_u64(&mut b, root.live_chunks);
    put_u64(&mut b, root.live_stored_bytes);
    put_u32(&mut b, root.segment_live.len() as u32);
    for (seg, bytes) in &root.segment_live {
        put_u32(&mut b, *seg);
        put_u64(&mut b, *bytes);
    }
    put_u64(&mut b, root.meta_bytes_written);
    put_u64(&mut b, root.checkpoints);
    put_u64(&mut b, root.bitmap.len() as u64);
    for w in &root.bitmap {
        put_u64(&mut b, *w);
    }
    put_u32(&mut b, root.meta.len() as u32);
    for (k, v) in &root.meta {
        put_u16(&mut b, k.len() as u16);
        b.extend_from_slice(k.as_bytes());
        put_u32(&mut b, v.len() as u32);
        b.extend_from_slice(v);
    }
    encode_extensions(&mut b, root);
    let body =
        zstd::bulk::compress(&b, 1).map_err(|e| Error::io("compressing the checkpoint root", e))?;
    let raw_len = u32::try_from(b.len()).map_err(|_| {
        Error::Invalid("checkpoint root over 4 GiB (too many metadata records)".into())
    })?;
    let body = match crypto {
        Some(c) => c.sealed(
            Kind::Root,
            &root_ctx(raw_len, root.journal_gen, root.next_seq),
            &body,
        )?,
        None => body,
    };
    let mut out = Vec::with_capacity(ROOT_HEADER_BYTES + body.len());
    out.extend_from_slice(&CHECKPOINT_MAGIC);
    put_u32(
        &mut out,
        if root.deltas.is_some() {
            ROOT_VERSION_DELTAS
        } else if root.forwards.is_some() {
            ROOT_VERSION_FORWARDS
        } else if root.releasing.is_empty() {
            FORMAT_VERSION
        } else {
            ROOT_VERSION_RELEASING
        },
    );
    put_u32(&mut out, raw_len);
    put_u64(&mut out, root.journal_gen);
    put_u64(&mut out, root.next_seq);
    out.extend_from_slice(uuid);
    put_u32(&mut out, body.len() as u32);
    put_u32(&mut out, crc(&[&body]));
    out.resize(ROOT_HEADER_BYTES - 4, 0);
    let c = crc(&[&out]);
    put_u32(&mut out, c);
    out.extend_from_slice(&body);
    Ok(out)
}

/// The sections after the body: the snapshot extension, then the release section, each only
/// when there is something to say (a pool without snapshots, clones or pending releases
/// keeps the plain format 2 body).
fn encode_extensions(b: &mut Vec<u8>, root: &Root) {
    let extended: Vec<&RootVolume> = root
        .volumes
        .iter()
        .filter(|v| v.snapshot_of.is_some() || v.created != 0)
        .collect();
    if !extended.is_empty() || !root.shared_pages.is_empty() {
        put_u32(b, ROOT_SNAPSHOT_EXT_MAGIC);
        put_u32(b, ROOT_SNAPSHOT_EXT_VERSION);
        put_u32(b, extended.len() as u32);
        for v in extended {
            put_u32(b, v.id);
            put_u32(b, v.snapshot_of.unwrap_or(u32::MAX));
            put_u64(b, v.created);
        }
        put_u64(b, root.shared_pages.len() as u64);
        for (page, refs) in &root.shared_pages {
            put_u64(b, *page);
            put_u32(b, *refs);
        }
    }
    if !root.releasing.is_empty() {
        put_u32(b, ROOT_RELEASE_EXT_MAGIC);
        put_u32(b, ROOT_RELEASE_EXT_VERSION);
        put_u32(b, root.releasing.len() as u32);
        for x in &root.releasing {
            put_u64(b, x.tree);
            put_u64(b, x.end);
            put_u64(b, x.next);
            put_u64(b, x.data_blocks);
            put_u16(b, x.name.len() as u16);
            b.extend_from_slice(x.name.as_bytes());
        }
    }
    if let Some(n) = root.forwards {
        put_u32(b, ROOT_FORWARD_EXT_MAGIC);
        put_u32(b, ROOT_FORWARD_EXT_VERSION);
        put_u64(b, n);
    }
    if let Some(n) = root.deltas {
        put_u32(b, ROOT_DELTA_EXT_MAGIC);
        put_u32(b, ROOT_DELTA_EXT_VERSION);
        put_u64(b, n);
    }
}

/// Decode a checkpoint root; in an encrypted pool (`crypto`) its body is opened first.
pub fn decode_root(buf: &[u8], uuid: &[u8; 16], crypto: Option<&Crypto>) -> Result<Root> {
    let h = decode_root_header(buf, uuid)?;
    let opened;
    let body = match crypto {
        Some(c) => {
            opened = c.open(
                Kind::Root,
                &root_ctx(h.raw_len as u32, h.journal_gen, h.next_seq),
                h.body,
                || format!("the checkpoint root (file {CHECKPOINT_NAME}, {} bytes at offset {ROOT_HEADER_BYTES})", h.body.len()),
            )?;
            &opened[..]
        }
        None => h.body,
    };
    let raw = decompress_root(body, h.raw_len)?;
    decode_root_body(&raw, h.journal_gen, h.next_seq)
}

/// What a root's header says, and its stored body (CRC checked).
struct RootHeader<'a> {
    raw_len: usize,
    journal_gen: u64,
    next_seq: u64,
    body: &'a [u8],
}

/// The header of a checkpoint root: magic, version, its CRC, the pool, and the stored body
/// whose CRC it holds.
fn decode_root_header<'a>(buf: &'a [u8], uuid: &[u8; 16]) -> Result<RootHeader<'a>> {
    const WHAT: &str = "checkpoint root";
    if buf.len() < ROOT_HEADER_BYTES {
        return Err(Error::corrupt(WHAT, format!("only {} bytes", buf.len())));
    }
    let mut r = Reader::new(buf, WHAT);
    check_magic(r.bytes(8)?, &CHECKPOINT_MAGIC, WHAT)?;
    let version = r.u32()?;
    if !matches!(
        version,
        ROOT_VERSION_RELEASING | ROOT_VERSION_FORWARDS | ROOT_VERSION_DELTAS
    ) {
        check_version(version, WHAT)?;
    }
    let stored = u32::from_le_bytes([buf[60], buf[61], buf[62], buf[63]]);
    check_crc(stored, crc(&[&buf[..ROOT_HEADER_BYTES - 4]]), WHAT)?;
    let raw_len = r.u32()? as usize;
    let journal_gen = r.u64()?;
    let next_seq = r.u64()?;
    let found_uuid: [u8; 16] = r.array()?;
    if &found_uuid != uuid {
        return Err(Error::corrupt(
            WHAT,
            "the checkpoint belongs to another pool",
        ));
    }
    let body_len = r.u32()? as usize;
    let body_crc = r.u32()?;
    let body = buf
        .get(ROOT_HEADER_BYTES..ROOT_HEADER_BYTES + body_len)
        .ok_or_else(|| Error::corrupt(WHAT, "body truncated"))?;
    check_crc(body_crc, crc(&[body]), WHAT)?;
    Ok(RootHeader {
        raw_len,
        journal_gen,
        next_seq,
        body,
    })
}

/// The decompressed body of a root: volumes, trees, counters, the page bitmap, metadata
/// records, then the snapshot extension if any.
fn decode_root_body(raw: &[u8], journal_gen: u64, next_seq: u64) -> Result<Root> {
    const WHAT: &str = "checkpoint root";
    let mut r = Reader::new(raw, WHAT);
    let mut root = Root {
        journal_gen,
        next_seq,
        next_vol: r.u32()?,
        ..Default::default()
    };
    for _ in 0..r.u32()? {
        let id = r.u32()?;
        let size = r.u64()?;
        let data_blocks = r.u64()?;
        let zero_blocks = r.u64()?;
        let n = r.u16()? as usize;
        root.volumes.push(RootVolume {
            id,
            size,
            data_blocks,
            zero_blocks,
            name: r.string(n)?,
            snapshot_of: None,
            created: 0,
        });
    }
    for _ in 0..r.u32()? {
        root.trees.push(RootTree {
            id: r.u64()?,
            height: r.u8()?,
            page: r.u64()?,
            crc: r.u32()?,
            units: r.u16()?,
            codec: r.u8()?,
        });
    }
    root.next_chunk = r.u64()?;
    root.live_chunks = r.u64()?;
    root.live_stored_bytes = r.u64()?;
    for _ in 0..r.u32()? {
        root.segment_live.push((r.u32()?, r.u64()?));
    }
    root.meta_bytes_written = r.u64()?;
    root.checkpoints = r.u64()?;
    let words = r.u64()?;
    if words > r.remaining() as u64 / 8 {
        return Err(Error::corrupt(WHAT, "page bitmap longer than the body"));
    }
    for _ in 0..words {
        root.bitmap.push(r.u64()?);
    }
    for _ in 0..r.u32()? {
        let n = r.u16()? as usize;
        let k = r.string(n)?;
        let n = r.u32()? as usize;
        root.meta.push((k, r.bytes(n)?.to_vec()));
    }
    // The sections in their order, each at most once: snapshot, release, forward, delta.
    let mut seen = 0;
    while r.remaining() != 0 {
        match r.u32()? {
            ROOT_SNAPSHOT_EXT_MAGIC if seen < 1 => {
                seen = 1;
                decode_snapshot_extension(&mut r, &mut root)?;
            }
            ROOT_RELEASE_EXT_MAGIC if seen < 2 => {
                seen = 2;
                decode_release_extension(&mut r, &mut root)?;
            }
            ROOT_FORWARD_EXT_MAGIC if seen < 3 => {
                seen = 3;
                let v = r.u32()?;
                if v != ROOT_FORWARD_EXT_VERSION {
                    return Err(Error::corrupt(
                        WHAT,
                        format!("forward section version {v}; this build reads version {ROOT_FORWARD_EXT_VERSION} (upgrade Condense)"),
                    ));
                }
                root.forwards = Some(r.u64()?);
            }
            ROOT_DELTA_EXT_MAGIC if seen < 4 => {
                seen = 4;
                let v = r.u32()?;
                if v != ROOT_DELTA_EXT_VERSION {
                    return Err(Error::corrupt(
                        WHAT,
                        format!("delta section version {v}; this build reads version {ROOT_DELTA_EXT_VERSION} (upgrade Condense)"),
                    ));
                }
                root.deltas = Some(r.u64()?);
            }
            _ => return Err(Error::corrupt(WHAT, "unknown section after the body")),
        }
    }
    Ok(root)
}

/// The snapshot extension at the end of a root body: what each volume is a snapshot of and
/// when it was made, and the pages named more than once.
fn decode_snapshot_extension(r: &mut Reader<'_>, root: &mut Root) -> Result<()> {
    const WHAT: &str = "checkpoint root";
    let v = r.u32()?;
    if v != ROOT_SNAPSHOT_EXT_VERSION {
        return Err(Error::corrupt(
            WHAT,
            format!("snapshot section version {v}; this build reads version {ROOT_SNAPSHOT_EXT_VERSION} (upgrade Condense)"),
        ));
    }
    for _ in 0..r.u32()? {
        let id = r.u32()?;
        let of = r.u32()?;
        let created = r.u64()?;
        let vol = root
            .volumes
            .iter_mut()
            .find(|v| v.id == id)
            .ok_or_else(|| {
                Error::corrupt(WHAT, format!("snapshot section names unknown volume {id}"))
            })?;
        vol.snapshot_of = (of != u32::MAX).then_some(of);
        vol.created = created;
    }
    let n = r.u64()?;
    if n > r.remaining() as u64 / 12 {
        return Err(Error::corrupt(
            WHAT,
            "shared page list longer than the body",
        ));
    }
    for _ in 0..n {
        root.shared_pages.push((r.u64()?, r.u32()?));
    }
    Ok(())
}

/// The release section (its tag read): the deleted volumes' maps still being released, each
/// naming a tree of the root at or above [`RELEASE_TREE_FIRST`], once.
fn decode_release_extension(r: &mut Reader<'_>, root: &mut Root) -> Result<()> {
    const WHAT: &str = "checkpoint root";
    let v = r.u32()?;
    if v != ROOT_RELEASE_EXT_VERSION {
        return Err(Error::corrupt(
            WHAT,
            format!("release section version {v}; this build reads version {ROOT_RELEASE_EXT_VERSION} (upgrade Condense)"),
        ));
    }
    let n = r.u32()?;
    if u64::from(n) > r.remaining() as u64 / 34 {
        return Err(Error::corrupt(WHAT, "release list longer than the body"));
    }
    for _ in 0..n {
        let tree = r.u64()?;
        let end = r.u64()?;
        let next = r.u64()?;
        let data_blocks = r.u64()?;
        let len = r.u16()? as usize;
        let name = r.string(len)?;
        let named = root.trees.iter().any(|t| t.id == tree);
        let twice = root.releasing.iter().any(|x| x.tree == tree);
        if tree < RELEASE_TREE_FIRST || tree == u64::MAX || !named || twice {
            return Err(Error::corrupt(
                WHAT,
                format!(
                    "release section names tree {tree}, which is not a detached tree of this root"
                ),
            ));
        }
        root.releasing.push(RootRelease {
            tree,
            name,
            end,
            next,
            data_blocks,
        });
    }
    Ok(())
}

/// The body of a checkpoint root, which must be `raw_len` bytes. The buffer grows with what
/// the body really holds: `raw_len` is read from the file and never allocated up front (up to
/// 4 GiB for a header of 64 bytes).
fn decompress_root(body: &[u8], raw_len: usize) -> Result<Vec<u8>> {
    use std::io::Read;
    const WHAT: &str = "checkpoint root";
    let bad = |e: std::io::Error| Error::corrupt(WHAT, format!("body does not decompress: {e}"));
    let mut raw = Vec::new();
    zstd::stream::read::Decoder::with_buffer(body)
        .map_err(bad)?
        .take(raw_len as u64 + 1)
        .read_to_end(&mut raw)
        .map_err(bad)?;
    if raw.len() != raw_len {
        return Err(Error::corrupt(
            WHAT,
            format!(
                "body decompresses to {}{} bytes, the header says {raw_len}",
                raw.len(),
                if raw.len() > raw_len { " or more" } else { "" }
            ),
        ));
    }
    Ok(raw)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crc;
    /// Found writing the checkpoint_root fuzz target: the root body's length was read from the
    /// header and allocated before decompressing, so a checkpoint of 100 bytes whose header
    /// said 4 GiB (with a CRC, which anyone can compute) allocated 4 GiB. Now the buffer grows
    /// with what the body holds, and a body of another length is an error.
    #[test]
    fn a_root_header_cannot_make_the_decoder_allocate() -> Result<()> {
        let uuid = [5; 16];
        let good = encode_root(&Root::default(), &uuid, None)?;
        assert_eq!(decode_root(&good, &uuid, None)?, Root::default());
        for raw_len in [u32::MAX, 1 << 30, 3] {
            let mut b = good.clone();
            b[12..16].copy_from_slice(&raw_len.to_le_bytes());
            let c = crc(&[&b[..ROOT_HEADER_BYTES - 4]]);
            b[ROOT_HEADER_BYTES - 4..ROOT_HEADER_BYTES].copy_from_slice(&c.to_le_bytes());
            match decode_root(&b, &uuid, None) {
                Err(Error::Corrupt { detail, .. }) => {
                    assert!(detail.contains("decompresses to"), "{detail}")
                }
                other => panic!("raw length {raw_len}: {other:?}"),
            }
        }
        Ok(())
    }

    fn full_root() -> Root {
        Root {
            journal_gen: 4,
            next_seq: 99,
            next_vol: 3,
            volumes: vec![
                RootVolume {
                    id: 1,
                    size: 1 << 30,
                    data_blocks: 10,
                    zero_blocks: 2,
                    name: "vm".into(),
                    snapshot_of: None,
                    created: 0,
                },
                RootVolume {
                    id: 2,
                    size: 1 << 30,
                    data_blocks: 10,
                    zero_blocks: 2,
                    name: "vm@s".into(),
                    snapshot_of: Some(1),
                    created: 1_700_000_000,
                },
            ],
            trees: vec![RootTree {
                id: u64::MAX,
                height: 2,
                page: 64,
                crc: 5,
                units: 3,
                codec: 1,
            }],
            next_chunk: 1000,
            live_chunks: 900,
            live_stored_bytes: 1 << 20,
            segment_live: vec![(1, 4096), (2, 8192)],
            meta_bytes_written: 1 << 22,
            checkpoints: 7,
            bitmap: vec![u64::MAX, 3],
            meta: vec![("scrub/last".into(), b"started=1".to_vec())],
            shared_pages: vec![(64, 2)],
            releasing: Vec::new(),
            forwards: None,
            deltas: None,
        }
    }

    /// A root of a pool with delta compression on: the delta section round-trips under
    /// version 5 (which builds before it refuse), with and without forwards.
    #[test]
    fn deltas_round_trip_under_their_own_version() -> Result<()> {
        let uuid = [7; 16];
        let mut root = full_root();
        root.deltas = Some(0);
        let b = encode_root(&root, &uuid, None)?;
        assert_eq!(
            u32::from_le_bytes([b[8], b[9], b[10], b[11]]),
            ROOT_VERSION_DELTAS
        );
        assert_eq!(decode_root(&b, &uuid, None)?, root);
        root.deltas = Some(99);
        root.forwards = Some(3);
        let b = encode_root(&root, &uuid, None)?;
        assert_eq!(
            u32::from_le_bytes([b[8], b[9], b[10], b[11]]),
            ROOT_VERSION_DELTAS
        );
        assert_eq!(decode_root(&b, &uuid, None)?, root);
        for cut in 0..b.len() {
            assert!(decode_root(&b[..cut], &uuid, None).is_err(), "cut {cut}");
        }
        Ok(())
    }

    /// A root of a pool the merge pass made forwards in: the forward section round-trips
    /// under version 4 (which builds before it refuse), with or without the other sections.
    #[test]
    fn forwards_round_trip_under_their_own_version() -> Result<()> {
        let uuid = [6; 16];
        let mut root = full_root();
        root.forwards = Some(0);
        let b = encode_root(&root, &uuid, None)?;
        assert_eq!(
            decode_root(&b, &uuid, None)?,
            root,
            "allowed, none made yet"
        );
        root.forwards = Some(12);
        let b = encode_root(&root, &uuid, None)?;
        assert_eq!(
            u32::from_le_bytes([b[8], b[9], b[10], b[11]]),
            ROOT_VERSION_FORWARDS
        );
        assert_eq!(decode_root(&b, &uuid, None)?, root);
        let mut plain = root.clone();
        plain.volumes.retain(|v| v.snapshot_of.is_none());
        plain.shared_pages.clear();
        let b = encode_root(&plain, &uuid, None)?;
        assert_eq!(decode_root(&b, &uuid, None)?, plain);
        for cut in 0..b.len() {
            assert!(decode_root(&b[..cut], &uuid, None).is_err(), "cut {cut}");
        }
        Ok(())
    }

    /// A root with a release pending: the release section round-trips, the header says
    /// version 3 (which builds before it refuse: they check for version 2), and a section
    /// naming a tree the root lacks is an error.
    #[test]
    fn a_pending_release_round_trips_under_its_own_version() -> Result<()> {
        let uuid = [5; 16];
        let mut root = full_root();
        let tree = RELEASE_TREE_FIRST + 7;
        root.trees.push(RootTree {
            id: tree,
            height: 3,
            page: 128,
            crc: 9,
            units: 2,
            codec: 0,
        });
        root.releasing.push(RootRelease {
            tree,
            name: "old-vm".into(),
            end: 2048,
            next: 512,
            data_blocks: 1 << 20,
        });
        let b = encode_root(&root, &uuid, None)?;
        assert_eq!(
            u32::from_le_bytes([b[8], b[9], b[10], b[11]]),
            ROOT_VERSION_RELEASING
        );
        assert_eq!(decode_root(&b, &uuid, None)?, root);
        for cut in 0..b.len() {
            assert!(decode_root(&b[..cut], &uuid, None).is_err(), "cut {cut}");
        }
        // Without the snapshot extension the release section follows the body directly.
        let mut plain = root.clone();
        plain.volumes.retain(|v| v.snapshot_of.is_none());
        plain.shared_pages.clear();
        let b = encode_root(&plain, &uuid, None)?;
        assert_eq!(decode_root(&b, &uuid, None)?, plain);
        // A release of a tree the root does not hold.
        let mut bad = root.clone();
        bad.trees.retain(|t| t.id != tree);
        let b = encode_root(&bad, &uuid, None)?;
        assert!(decode_root(&b, &uuid, None).is_err());
        // Nothing pending: the plain version, as before.
        let b = encode_root(&full_root(), &uuid, None)?;
        assert_eq!(
            u32::from_le_bytes([b[8], b[9], b[10], b[11]]),
            FORMAT_VERSION
        );
        Ok(())
    }

    #[test]
    fn a_full_root_round_trips_and_damage_is_an_error() -> Result<()> {
        let uuid = [5; 16];
        let root = full_root();
        let b = encode_root(&root, &uuid, None)?;
        assert_eq!(decode_root(&b, &uuid, None)?, root);
        assert!(decode_root(&b, &[6; 16], None).is_err(), "another pool");
        for cut in 0..b.len() {
            assert!(decode_root(&b[..cut], &uuid, None).is_err(), "cut {cut}");
        }
        for at in [0, 9, 20, 40, 70, b.len() - 1] {
            let mut bad = b.clone();
            bad[at] ^= 0x20;
            assert!(decode_root(&bad, &uuid, None).is_err(), "flip at {at}");
        }
        Ok(())
    }
}

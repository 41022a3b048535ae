//! Checkpoints: the whole metadata state in one file, written atomically, so the journal can
//! start over.
//!
//! Owns: encoding the state into sections (volume list, one block map per volume, the chunk
//! table in runs of 65536 ids, metadata records) and loading it back.
//! Invariants:
//! - Reference counts are not stored: loading recomputes them from the block maps.
//! - A section that fails its checksum damages only what it holds: a volume's map (the volume
//!   then fails reads and refuses writes) or a run of chunk ids (blocks naming them fail
//!   reads). Damage is listed in `problems` and reported by `condense verify`. Only a damaged
//!   header or volume list stops the pool from opening.

use crate::block_map::BlockMap;
use crate::chunk_table::ChunkTable;
use crate::error::{Error, Result};
use crate::format::*;
use crate::pool::{State, VolumeState};
use std::collections::BTreeMap;

/// Bytes of one chunk slot in a Chunks section.
const CHUNK_SLOT_BYTES: usize = 28;

/// A checkpoint as loaded.
pub(crate) struct Loaded {
    pub journal_gen: u64,
    pub next_seq: u64,
    pub next_vol: u32,
    pub volumes: BTreeMap<u32, VolumeState>,
    pub chunks: ChunkTable,
    pub meta: BTreeMap<String, Vec<u8>>,
    pub problems: Vec<String>,
}

pub(crate) fn encode(
    st: &State,
    journal_gen: u64,
    next_seq: u64,
    uuid: &[u8; 16],
) -> Result<Vec<u8>> {
    let mut body = Vec::new();
    let mut sections = 0u32;
    let vols: Vec<(u32, u64, &str)> = st
        .volumes
        .iter()
        .map(|(&id, v)| (id, v.size, v.name.as_str()))
        .collect();
    encode_section(
        &mut body,
        SectionKind::Volumes,
        0,
        &encode_volumes(st.next_vol, &vols),
    )?;
    sections += 1;
    for (&id, v) in &st.volumes {
        match &v.damaged {
            // Carry a damaged section over as it was, so its damage stays visible.
            Some(raw) => body.extend_from_slice(raw),
            None => encode_section(
                &mut body,
                SectionKind::Map,
                id,
                &encode_map(&mut v.map.pages()),
            )?,
        }
        sections += 1;
    }
    let len = st.chunks.len();
    let mut first = 0u32;
    while first < len {
        let end = (first as usize + CHUNKS_PER_SECTION).min(len as usize) as u32;
        let mut raw = Vec::with_capacity((end - first) as usize * CHUNK_SLOT_BYTES);
        for id in first..end {
            match st.chunks.get(id) {
                Some(e) if e.is_damaged() => encode_damaged_slot(&mut raw),
                e => {
                    let slot = e.and_then(|e| e.location().map(|l| (l, e.fp)));
                    encode_chunk_slot(&mut raw, slot.as_ref().map(|(l, fp)| (l, fp)));
                }
            }
        }
        encode_section(&mut body, SectionKind::Chunks, first, &raw)?;
        sections += 1;
        first = end;
    }
    encode_section(
        &mut body,
        SectionKind::Meta,
        0,
        &encode_meta(&mut st.meta.iter()),
    )?;
    sections += 1;
    let header = CheckpointHeader {
        journal_gen,
        next_seq,
        sections,
    };
    let mut out = encode_checkpoint_header(&header, uuid);
    out.extend_from_slice(&body);
    Ok(out)
}

pub(crate) fn load(buf: &[u8], sb: &Superblock) -> Result<Loaded> {
    let h = decode_checkpoint_header(buf, &sb.uuid)?;
    let mut out = Loaded {
        journal_gen: h.journal_gen,
        next_seq: h.next_seq,
        next_vol: 0,
        volumes: BTreeMap::new(),
        chunks: ChunkTable::default(),
        meta: BTreeMap::new(),
        problems: Vec::new(),
    };
    // First pass: split into sections.
    let mut pos = CHECKPOINT_HEADER_BYTES;
    let mut parts = Vec::new();
    for i in 0..h.sections {
        let hdr = buf.get(pos..pos + SECTION_HEADER_BYTES).ok_or_else(|| {
            Error::corrupt(
                "checkpoint",
                format!("section {i} header past the end of the file"),
            )
        })?;
        let sh = decode_section_header(hdr)?;
        let start = pos + SECTION_HEADER_BYTES;
        let body = buf
            .get(start..start + sh.stored_len as usize)
            .ok_or_else(|| {
                Error::corrupt(
                    "checkpoint",
                    format!("section {i} runs past the end of the file"),
                )
            })?;
        parts.push((sh, body, &buf[pos..start + body.len()]));
        pos = start + body.len();
    }
    let mut maps = Vec::new();
    for (sh, body, raw_section) in parts {
        match sh.kind {
            k if k == SectionKind::Volumes as u8 => {
                let raw = decode_section_body(&sh, body, "checkpoint volume list")?;
                let (next, rows) = decode_volumes(&raw)?;
                out.next_vol = next;
                for (id, size, name) in rows {
                    out.volumes.insert(
                        id,
                        VolumeState {
                            name,
                            size,
                            map: BlockMap::default(),
                            damaged: None,
                        },
                    );
                }
            }
            k if k == SectionKind::Map as u8 => maps.push((sh, body, raw_section)),
            k if k == SectionKind::Chunks as u8 => {
                let count = sh.raw_len as usize / CHUNK_SLOT_BYTES;
                let first = sh.id;
                let what = format!(
                    "checkpoint chunk table, ids {first}..{}",
                    first as usize + count
                );
                match decode_section_body(&sh, body, &what).and_then(|raw| {
                    let mut r = Reader::new(&raw, "checkpoint chunk table");
                    let mut slots = Vec::with_capacity(count);
                    for _ in 0..count {
                        slots.push(decode_chunk_slot(&mut r)?);
                    }
                    Ok(slots)
                }) {
                    Ok(slots) => {
                        for (k, slot) in slots.into_iter().enumerate() {
                            let id = first + k as u32;
                            match slot {
                                ChunkSlot::Live(loc, fp) => out.chunks.insert(id, fp, &loc),
                                ChunkSlot::Damaged => {
                                    out.problems
                                        .push(format!("chunk {id} was found damaged earlier"));
                                    out.chunks.mark_damaged(id);
                                }
                                ChunkSlot::Free => {}
                            }
                        }
                    }
                    Err(e) => {
                        out.problems.push(e.to_string());
                        for id in first..first + count as u32 {
                            out.chunks.mark_damaged(id);
                        }
                    }
                }
            }
            k if k == SectionKind::Meta as u8 => {
                match decode_section_body(&sh, body, "checkpoint metadata records")
                    .and_then(|raw| decode_meta(&raw))
                {
                    Ok(rows) => out.meta.extend(rows),
                    Err(e) => out.problems.push(e.to_string()),
                }
            }
            k => {
                return Err(Error::corrupt(
                    "checkpoint",
                    format!("unknown section kind {k}"),
                ))
            }
        }
    }
    for (sh, body, raw_section) in maps {
        let Some(v) = out.volumes.get_mut(&sh.id) else {
            out.problems.push(format!(
                "checkpoint holds a block map for unknown volume {}",
                sh.id
            ));
            continue;
        };
        let what = format!("checkpoint block map of volume {:?}", v.name);
        let chunks = &mut out.chunks;
        let loaded = decode_section_body(&sh, body, &what).and_then(|raw| {
            decode_map(&raw, |page_no, entries| {
                for &e in entries {
                    if e < CHUNK_ID_LIMIT {
                        chunks.incref(e);
                    }
                }
                v.map.load_page(page_no, entries);
            })
        });
        if let Err(e) = loaded {
            out.problems.push(e.to_string());
            v.damaged = Some(raw_section.to_vec());
        }
    }
    // A map naming a chunk the table does not hold: those blocks are damaged.
    let dangling: Vec<u32> = (0..out.chunks.len())
        .filter(|&id| out.chunks.get(id).is_none() && out.chunks.refs_of_free(id) > 0)
        .collect();
    for id in dangling {
        out.problems.push(format!(
            "chunk {id} is referenced by a block map but missing from the chunk table"
        ));
        out.chunks.mark_damaged(id);
    }
    Ok(out)
}

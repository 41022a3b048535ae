//! The pool's history of accepted losses: what each `condense repair` gave up, kept as
//! metadata records (`damage/<UTC time>`) so that `condense verify` still lists it.
//!
//! Owns: the records' encoding and [`LostRange`], the lost blocks of one volume. Repair
//! ([`crate::repair`], which re-exports these) writes them into the metadata it rebuilds;
//! verify reads them ([`damage_history`]); `condense repair --clear-history` deletes them.

use crate::error::Result;

use super::Pool;

/// Blocks of one volume or snapshot that repair could not salvage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LostRange {
    /// The volume, or `VOLUME@SNAPSHOT` for a snapshot.
    pub volume: String,
    pub first_block: u64,
    pub blocks: u64,
    /// Why, and what the blocks read now.
    pub reason: String,
}

/// The pool's metadata records that keep what each repair lost, named `damage/<UTC time>`:
/// an administrator who accepted the loss still sees it in `condense verify` until
/// `condense repair --clear-history` forgets it (as `zpool status -v` lists permanent errors
/// until `zpool clear`).
pub const DAMAGE_PREFIX: &str = "damage/";

/// What one repair lost, as kept in the pool's history.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DamageRecord {
    /// When the repair ran (UTC, as in the name of its backup directory).
    pub when: String,
    pub lost: Vec<LostRange>,
}

/// A history record's bytes: one line per lost range, `volume TAB first TAB blocks TAB
/// reason` (names and reasons hold no tab or newline: they are replaced by spaces).
pub(crate) fn encode_damage(lost: &[LostRange]) -> Vec<u8> {
    let clean = |s: &str| s.replace(['\t', '\n'], " ");
    lost.iter()
        .map(|l| {
            format!(
                "{}\t{}\t{}\t{}\n",
                clean(&l.volume),
                l.first_block,
                l.blocks,
                clean(&l.reason)
            )
        })
        .collect::<String>()
        .into_bytes()
}

/// Decode a history record (lines that do not parse are skipped: it is informational).
pub(crate) fn decode_damage(bytes: &[u8]) -> Vec<LostRange> {
    String::from_utf8_lossy(bytes)
        .lines()
        .filter_map(|line| {
            let mut f = line.splitn(4, '\t');
            Some(LostRange {
                volume: f.next()?.to_string(),
                first_block: f.next()?.parse().ok()?,
                blocks: f.next()?.parse().ok()?,
                reason: f.next()?.to_string(),
            })
        })
        .collect()
}

/// Every repair's losses still in the pool's history, oldest first.
pub fn damage_history(pool: &Pool) -> Vec<DamageRecord> {
    pool.meta_keys(DAMAGE_PREFIX)
        .into_iter()
        .filter_map(|key| {
            let bytes = pool.meta_get(&key)?;
            Some(DamageRecord {
                when: key.strip_prefix(DAMAGE_PREFIX).unwrap_or(&key).to_string(),
                lost: decode_damage(&bytes),
            })
        })
        .collect()
}

/// Forget every repair's losses (`condense repair --clear-history`); returns how many records
/// there were.
pub fn clear_damage_history(pool: &Pool) -> Result<usize> {
    let keys = pool.meta_keys(DAMAGE_PREFIX);
    for k in &keys {
        pool.meta_put(k, None)?;
    }
    pool.flush()?;
    Ok(keys.len())
}

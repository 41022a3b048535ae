//! The pool's history of accepted losses: what each `condense repair` gave up, kept as
//! metadata records (`damage/<UTC time>`) so that `condense verify` still lists it.
//!
//! Owns: reading and clearing the history (the records' encoding is
//! condense-format's `damage`, re-exported here). Repair
//! ([`crate::repair`], which re-exports these) writes them into the metadata it rebuilds;
//! verify reads them ([`damage_history`]); `condense repair --clear-history` deletes them.

use crate::error::Result;

use super::Pool;

pub use crate::format::damage::{
    decode_damage, encode_damage, DamageRecord, LostRange, DAMAGE_PREFIX,
};

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

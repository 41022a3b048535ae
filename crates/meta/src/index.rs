//! The pool's dedup index, dense or sparse, behind one interface, and the pool setting that
//! chooses it.
//!
//! Owns: [`Index`] (what [`crate::metadata::Metadata`] holds) and [`IndexSetting`], stored as
//! the named metadata record [`SETTING_KEY`] (docs/FORMAT.md "Dedup index mode").
//!
//! Invariants: both modes answer a lookup with chunk-table pages only; the caller compares
//! full fingerprints on the page, so dedup stays exact whatever the mode, and a miss costs
//! savings only (docs/DESIGN.md invariant 3). The setting is read when the index is built
//! (the first write after open), so a change takes effect at the next open.

use crate::dedup_index::DedupIndex;
use crate::sparse_index::SparseIndex;
use condense_format::error::{Error, Result};
use condense_format::Fingerprint;

/// The named metadata record holding the pool's index setting. Absent: dense.
pub const SETTING_KEY: &str = "index/mode";

/// Which index a pool builds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum IndexSetting {
    /// Every unique chunk indexed (~7.8 bytes of RAM each).
    #[default]
    Dense,
    /// Hooks and a locality cache within this many bytes.
    Sparse { budget: u64 },
}

/// The sparse budget when none is given.
pub const DEFAULT_SPARSE_BUDGET: u64 = 32 << 20;

impl IndexSetting {
    /// The record's value: `dense`, or `sparse BYTES`.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            IndexSetting::Dense => b"dense".to_vec(),
            IndexSetting::Sparse { budget } => format!("sparse {budget}").into_bytes(),
        }
    }

    /// The setting a record holds; an error names what is wrong with it.
    pub fn decode(bytes: &[u8]) -> Result<IndexSetting> {
        let bad = |why: &str| Error::corrupt(SETTING_KEY, why.to_string());
        let s = std::str::from_utf8(bytes).map_err(|_| bad("not UTF-8"))?;
        let mut words = s.split(' ');
        match (words.next(), words.next(), words.next()) {
            (Some("dense"), None, None) => Ok(IndexSetting::Dense),
            (Some("sparse"), Some(n), None) => {
                let budget = n
                    .parse()
                    .map_err(|_| bad("a budget that is not a number"))?;
                if budget < crate::sparse_index::MIN_BUDGET {
                    return Err(bad("a budget below the minimum"));
                }
                Ok(IndexSetting::Sparse { budget })
            }
            _ => Err(bad("neither `dense` nor `sparse BYTES`")),
        }
    }

    /// The setting in the pool's named records (dense if absent; a damaged record is said
    /// and read as dense: the index is advisory).
    pub fn of(meta: &std::collections::BTreeMap<String, Vec<u8>>) -> IndexSetting {
        match meta.get(SETTING_KEY).map(|v| IndexSetting::decode(v)) {
            None => IndexSetting::Dense,
            Some(Ok(s)) => s,
            Some(Err(e)) => {
                tracing::warn!("{e}: using a dense dedup index");
                IndexSetting::Dense
            }
        }
    }

    pub fn mode(&self) -> &'static str {
        match self {
            IndexSetting::Dense => "dense",
            IndexSetting::Sparse { .. } => "sparse",
        }
    }

    /// The sparse budget (0 for dense, which has none).
    pub fn budget(&self) -> u64 {
        match self {
            IndexSetting::Dense => 0,
            IndexSetting::Sparse { budget } => *budget,
        }
    }
}

/// The index a pool holds.
pub enum Index {
    Dense(DedupIndex),
    Sparse(SparseIndex),
}

impl Default for Index {
    fn default() -> Self {
        Index::Dense(DedupIndex::default())
    }
}

impl Index {
    /// An empty index of `setting`'s mode, for a build over a table of `chunks` live chunks
    /// (allocated whole: a caller holding a lock makes it before taking the lock).
    pub fn empty(setting: IndexSetting, chunks: u64) -> Index {
        match setting {
            IndexSetting::Dense => Index::Dense(DedupIndex::with_capacity(chunks)),
            IndexSetting::Sparse { budget } => Index::Sparse(SparseIndex::new(budget)),
        }
    }

    pub fn setting(&self) -> IndexSetting {
        match self {
            Index::Dense(_) => IndexSetting::Dense,
            Index::Sparse(s) => IndexSetting::Sparse { budget: s.budget() },
        }
    }

    /// Warm the slots a lookup of `fp` starts at (dense only).
    pub fn prefetch(&self, fp: &Fingerprint) {
        if let Index::Dense(d) = self {
            d.prefetch(fp);
        }
    }

    /// A new chunk `fp` on chunk-table page `page`.
    pub fn insert(&mut self, fp: &Fingerprint, page: u64) {
        match self {
            Index::Dense(d) => d.insert(fp, page),
            Index::Sparse(s) => s.insert(fp, page),
        }
    }

    /// An existing chunk seen by the build at open (sparse keeps its hooks only).
    pub fn insert_built(&mut self, fp: &Fingerprint, page: u64) {
        match self {
            Index::Dense(d) => d.insert(fp, page),
            Index::Sparse(s) => s.add_hook(fp, page),
        }
    }

    pub fn remove(&mut self, fp: &Fingerprint, page: u64) {
        match self {
            Index::Dense(d) => d.remove(fp, page),
            Index::Sparse(s) => s.remove(fp, page),
        }
    }

    /// Entries held: chunks (dense) or hooks (sparse).
    pub fn len(&self) -> u64 {
        match self {
            Index::Dense(d) => d.len(),
            Index::Sparse(s) => s.hooks(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of memory the index holds.
    pub fn ram_bytes(&self) -> u64 {
        match self {
            Index::Dense(d) => d.ram_bytes(),
            Index::Sparse(s) => s.ram_bytes(),
        }
    }

    pub fn sparse(&self) -> Option<&SparseIndex> {
        match self {
            Index::Sparse(s) => Some(s),
            Index::Dense(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_round_trip_and_bad_records_are_refused() {
        for s in [
            IndexSetting::Dense,
            IndexSetting::Sparse { budget: 8 << 20 },
        ] {
            assert_eq!(IndexSetting::decode(&s.encode()).ok(), Some(s));
        }
        for bad in [
            &b"sparse"[..],
            b"sparse 12",
            b"sparse x",
            b"dense 3",
            b"\xff",
            b"",
        ] {
            assert!(IndexSetting::decode(bad).is_err(), "{bad:?}");
        }
    }
}

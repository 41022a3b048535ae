//! The "import in progress" mark of a volume: set when an import creates the volume, cleared
//! when the import completes or its volume is deleted, so a volume left by an import that was
//! killed is shown as incomplete (`stats`, `volume list`) instead of passing for a whole disk.
//!
//! Owns: the mark's metadata record (`cli/importing/<volume>`, the key the CLI used when it
//! kept the mark itself; docs/FORMAT.md).
//! Invariant: a deleted volume leaves no mark behind
//! (the mark's removal is journaled in the same batch as the deletion, [`Pool::delete_volume`]).

use super::Pool;
use crate::error::Result;

const PREFIX: &str = "cli/importing/";

/// The record key of `volume`'s mark.
pub(crate) fn key(volume: &str) -> String {
    format!("{PREFIX}{volume}")
}

impl Pool {
    /// Mark volume `volume` as being imported (`true`) or complete (`false`).
    pub fn set_importing(&self, volume: &str, on: bool) -> Result<()> {
        self.meta_put(&key(volume), on.then_some(b"1".as_slice()))
    }

    /// Whether volume `volume` is marked as being imported (an import that has not ended).
    pub fn is_importing(&self, volume: &str) -> bool {
        self.meta_get(&key(volume)).is_some()
    }
}

#[cfg(test)]
mod tests {
    use crate::{InitOptions, OpenOptions, Pool};

    #[test]
    fn the_mark_follows_the_import_and_goes_with_its_volume() {
        let tmp = tempfile::tempdir().expect("tempdir");
        Pool::init_path(tmp.path(), &InitOptions::default()).expect("init");
        let pool = Pool::open_path(tmp.path(), OpenOptions::default()).expect("open");
        pool.create_volume("vm", 1 << 20).expect("create");
        assert!(!pool.is_importing("vm"));
        pool.set_importing("vm", true).expect("mark");
        assert!(pool.is_importing("vm"));
        pool.set_importing("vm", false).expect("clear");
        assert!(!pool.is_importing("vm"));
        // A killed import leaves the mark; deleting the volume removes it, and a new volume
        // of the same name is not taken for an incomplete import.
        pool.set_importing("vm", true).expect("mark");
        pool.delete_volume("vm").expect("delete");
        pool.create_volume("vm", 1 << 20).expect("create again");
        assert!(!pool.is_importing("vm"));
        pool.close().expect("close");
        drop(pool);
        let pool = Pool::open_path(tmp.path(), OpenOptions::default()).expect("reopen");
        assert!(!pool.is_importing("vm"), "after replay too");
    }
}

//! The writeback staging layer: a [`Dir`] over the pool's directory that holds new segments
//! and the journal in a faster directory until they are moved down.
//!
//! Owns: which files are *held* (in the *upper* directory: a writeback cache's, or an S3
//! pool's local directory) and which are in the *lower* one (the pool directory: local, or a
//! bucket); where a new file goes; moving a held file down ([`Dir::move_down`]). The pool
//! composes it over every directory it opens ([`Staging::compose`]), so the core never asks
//! which directory a file is in: it opens, lists, removes and syncs through this layer, and a
//! pool without a writeback cache has a layer that holds nothing (no cost: files it does
//! not hold are the lower directory's own handles).
//!
//! Where a new file goes (everything not listed goes down: superblock, root, `meta.dat`,
//! `cache.conf`, the `.partial` copy of a move):
//! - a segment is held while the held segments' bytes are under the budget, or always when
//!   the lower store takes whole files only (a bucket: segments are uploaded whole);
//! - a journal is held while the budget is not 0 (fast fsyncs), or always over a bucket.
//!
//! Invariants:
//! - Once composed, a name is in one directory only. A segment found in both is a move that
//!   was interrupted after the lower copy was made durable: the lower copy is used, and the
//!   held one is removed by the first writable open ([`Staging::remove_shadowed`]).
//! - Moving down (the destager asks only for sealed segments, never written again): the
//!   lower copy is written as `NAME.partial`, synced, renamed to `NAME` and the lower
//!   directory synced before the held copy is removed, so a crash at any point leaves at
//!   least one whole copy. Handles open on a held file read the lower copy from then on
//!   (the same bytes). A file removed while it was being moved has its lower copy removed.
//! - [`Dir::sync_dir`] syncs the lower directory, and the upper one when a name was created,
//!   renamed or removed in it since its last sync.

use crate::io::{Dir, DirectWriter, File, StoreStatus};
use condense_format::locks::lock;
use condense_format::{parse_journal_name, parse_segment_name, PARTIAL_SUFFIX, SEGMENT_PREFIX};
use std::collections::BTreeMap;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};

/// Bytes per read and write while moving a file down.
const COPY_BYTES: usize = 8 << 20;

/// The writeback staging layer (see the module docs).
pub struct Staging {
    lower: Arc<dyn Dir>,
    stage: Mutex<Stage>,
    /// A name was created, renamed or removed in the upper directory since its last sync.
    upper_changed: AtomicBool,
}

struct Stage {
    upper: Option<Arc<dyn Dir>>,
    /// Bytes of segments new ones may be held up to.
    budget: u64,
    /// Held files by name, each behind a handle a move re-points to the lower copy.
    held: BTreeMap<String, Arc<HeldFile>>,
    /// The file a move is copying now, and whether it was removed meanwhile.
    moving: Option<(String, bool)>,
    /// Segments compose found in both directories: their upper copies, for
    /// [`Staging::remove_shadowed`].
    shadowed: Vec<String>,
}

/// A handle on a held file; after a move, on its lower copy.
struct HeldFile(RwLock<Arc<dyn File>>);

impl HeldFile {
    fn now(&self) -> Arc<dyn File> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
    fn point_to(&self, f: Arc<dyn File>) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = f;
    }
}

impl File for HeldFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.now().read_at(buf, offset)
    }
    fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        self.now().write_at(data, offset)
    }
    fn len(&self) -> io::Result<u64> {
        self.now().len()
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.now().set_len(len)
    }
    fn sync(&self) -> io::Result<()> {
        self.now().sync()
    }
    fn read_other_copy(&self, buf: &mut [u8], offset: u64) -> io::Result<bool> {
        self.now().read_other_copy(buf, offset)
    }
    fn will_need(&self, offset: u64, len: u64) {
        self.now().will_need(offset, len)
    }
}

/// `e`, saying which directory it came from.
fn in_dir(dir: &dyn Dir, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{}: {e}", dir.describe()))
}

impl Staging {
    /// The layer over `lower`, holding in `upper` (if any) up to `budget` bytes of new
    /// segments. Finds the files `upper` holds already (segments and journals of the pool;
    /// a segment also in `lower` is shadowed by it). Reads only.
    pub fn compose(
        lower: Arc<dyn Dir>,
        upper: Option<Arc<dyn Dir>>,
        budget: u64,
    ) -> io::Result<Staging> {
        let mut held = BTreeMap::new();
        let mut shadowed = Vec::new();
        if let Some(up) = &upper {
            let below: std::collections::BTreeSet<String> =
                lower.list(SEGMENT_PREFIX)?.into_iter().collect();
            for name in pool_files(&**up)? {
                if below.contains(&name) {
                    shadowed.push(name);
                } else {
                    let f = up.open(&name, false).map_err(|e| in_dir(&**up, e))?;
                    held.insert(name, Arc::new(HeldFile(RwLock::new(f))));
                }
            }
        }
        Ok(Staging {
            lower,
            stage: Mutex::new(Stage {
                upper,
                budget,
                held,
                moving: None,
                shadowed,
            }),
            upper_changed: AtomicBool::new(false),
        })
    }

    /// Remove the upper copies of segments compose found in the lower directory too (moves
    /// interrupted after the lower copy was durable), and sync the upper directory.
    pub fn remove_shadowed(&self) -> io::Result<()> {
        let (up, names) = {
            let mut s = lock(&self.stage);
            (s.upper.clone(), std::mem::take(&mut s.shadowed))
        };
        let Some(up) = up.filter(|_| !names.is_empty()) else {
            return Ok(());
        };
        for name in &names {
            up.remove(name).map_err(|e| in_dir(&*up, e))?;
        }
        up.sync_dir().map_err(|e| in_dir(&*up, e))
    }

    /// Whether a new file `name` is held (see the module docs).
    fn holds_new(&self, s: &Stage, name: &str) -> io::Result<bool> {
        if s.upper.is_none() {
            return Ok(false);
        }
        let whole = self.lower.whole_files_only();
        if parse_segment_name(name).is_some() {
            Ok(whole || held_segment_bytes(s)? < s.budget)
        } else {
            Ok(parse_journal_name(name).is_some() && (whole || s.budget > 0))
        }
    }

    /// Step 1 of a move: the bytes of `from` as a durable `name` in the lower directory.
    fn copy_down(&self, name: &str, from: &dyn File) -> io::Result<Arc<dyn File>> {
        let partial = format!("{name}{PARTIAL_SUFFIX}");
        let len = from.len()?;
        let to = self.lower.open(&partial, true)?;
        to.set_len(0)?;
        let mut buf = vec![0u8; COPY_BYTES.min(len as usize)];
        let mut at = 0u64;
        while at < len {
            let n = (len - at).min(buf.len() as u64) as usize;
            from.read_at(&mut buf[..n], at)?;
            to.write_at(&buf[..n], at)?;
            at += n as u64;
        }
        to.sync()?;
        self.lower.rename(&partial, name)?;
        self.lower.sync_dir()?;
        Ok(to)
    }
}

/// The pool's files in `dir`: segments and journals.
fn pool_files(dir: &dyn Dir) -> io::Result<Vec<String>> {
    let mut names = dir.list(SEGMENT_PREFIX).map_err(|e| in_dir(dir, e))?;
    names.retain(|n| parse_segment_name(n).is_some());
    let journals = dir
        .list(condense_format::JOURNAL_PREFIX)
        .map_err(|e| in_dir(dir, e))?;
    names.extend(
        journals
            .into_iter()
            .filter(|n| parse_journal_name(n).is_some()),
    );
    Ok(names)
}

fn held_segment_bytes(s: &Stage) -> io::Result<u64> {
    let mut sum = 0;
    for (name, f) in &s.held {
        if parse_segment_name(name).is_some() {
            sum += f.len()?;
        }
    }
    Ok(sum)
}

impl Dir for Staging {
    fn open(&self, name: &str, create: bool) -> io::Result<Arc<dyn File>> {
        let mut s = lock(&self.stage);
        if let Some(f) = s.held.get(name) {
            return Ok(f.clone());
        }
        if create && self.holds_new(&s, name)? {
            if let Some(up) = s.upper.clone() {
                let f = up.open(name, true).map_err(|e| in_dir(&*up, e))?;
                let held = Arc::new(HeldFile(RwLock::new(f)));
                s.held.insert(name.to_string(), held.clone());
                self.upper_changed.store(true, Ordering::SeqCst);
                return Ok(held);
            }
        }
        drop(s);
        self.lower.open(name, create)
    }

    fn exists(&self, name: &str) -> io::Result<bool> {
        if lock(&self.stage).held.contains_key(name) {
            return Ok(true);
        }
        self.lower.exists(name)
    }

    fn remove(&self, name: &str) -> io::Result<()> {
        let mut s = lock(&self.stage);
        if s.held.remove(name).is_some() {
            if let Some((moving, removed)) = &mut s.moving {
                if moving == name {
                    *removed = true;
                }
            }
            let up = s.upper.clone();
            drop(s);
            if let Some(up) = up {
                self.upper_changed.store(true, Ordering::SeqCst);
                up.remove(name).map_err(|e| in_dir(&*up, e))?;
            }
            return Ok(());
        }
        drop(s);
        self.lower.remove(name)
    }

    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        let mut s = lock(&self.stage);
        if let (Some(f), Some(up)) = (s.held.get(from).cloned(), s.upper.clone()) {
            up.rename(from, to).map_err(|e| in_dir(&*up, e))?;
            s.held.remove(from);
            s.held.insert(to.to_string(), f);
            self.upper_changed.store(true, Ordering::SeqCst);
            return Ok(());
        }
        drop(s);
        self.lower.rename(from, to)
    }

    fn list(&self, prefix: &str) -> io::Result<Vec<String>> {
        let mut names = self.lower.list(prefix)?;
        let s = lock(&self.stage);
        names.extend(s.held.keys().filter(|n| n.starts_with(prefix)).cloned());
        drop(s);
        names.sort();
        names.dedup();
        Ok(names)
    }

    fn sync_dir(&self) -> io::Result<()> {
        self.lower.sync_dir()?;
        let up = lock(&self.stage).upper.clone();
        if let Some(up) = up {
            // Cleared first: a name created during the sync sets it again.
            if self.upper_changed.swap(false, Ordering::SeqCst) {
                if let Err(e) = up.sync_dir() {
                    self.upper_changed.store(true, Ordering::SeqCst);
                    return Err(in_dir(&*up, e));
                }
            }
        }
        Ok(())
    }

    /// The lower directory's files and the held ones.
    fn total_bytes(&self) -> io::Result<u64> {
        let s = lock(&self.stage);
        let mut held = 0;
        for f in s.held.values() {
            held += f.len()?;
        }
        drop(s);
        Ok(self.lower.total_bytes()? + held)
    }

    /// The lower directory's: every held file ends up there.
    fn available_bytes(&self) -> io::Result<u64> {
        self.lower.available_bytes()
    }

    fn scratch_file(&self) -> io::Result<Option<Arc<dyn File>>> {
        self.lower.scratch_file()
    }

    fn describe(&self) -> String {
        self.lower.describe()
    }

    fn whole_files_only(&self) -> bool {
        self.lower.whole_files_only()
    }
    fn reads_cost_requests(&self) -> bool {
        self.lower.reads_cost_requests()
    }
    fn check_reachable(&self) -> condense_format::error::Result<()> {
        self.lower.check_reachable()
    }
    fn checkpoint_due(&self) -> bool {
        self.lower.checkpoint_due()
    }
    fn durability(&self) -> Option<condense_format::Durability> {
        self.lower.durability()
    }
    fn set_durability(&self, d: condense_format::Durability) -> bool {
        self.lower.set_durability(d)
    }
    fn store_status(&self) -> Option<StoreStatus> {
        self.lower.store_status()
    }
    fn segment_slot(&self) -> u8 {
        self.lower.segment_slot()
    }
    fn peers(&self) -> io::Result<Vec<crate::io::Peer>> {
        self.lower.peers()
    }
    fn volume_claims(&self) -> Option<Arc<dyn crate::io::VolumeClaims>> {
        self.lower.volume_claims()
    }

    fn open_direct(&self, name: &str) -> io::Result<Option<Arc<dyn DirectWriter>>> {
        let s = lock(&self.stage);
        if s.held.contains_key(name) {
            let up = s.upper.clone();
            drop(s);
            return match up {
                Some(up) => up.open_direct(name).map_err(|e| in_dir(&*up, e)),
                None => Ok(None),
            };
        }
        drop(s);
        self.lower.open_direct(name)
    }

    fn hold_in(&self, upper: Option<(Arc<dyn Dir>, u64)>) -> io::Result<()> {
        let mut s = lock(&self.stage);
        match upper {
            Some((up, budget)) => {
                let same = s.upper.as_ref().is_some_and(|u| Arc::ptr_eq(u, &up));
                if !same && !s.held.is_empty() {
                    return Err(io::Error::other(format!(
                        "{} files are still held in {}; they must be moved down first",
                        s.held.len(),
                        s.upper.as_ref().map_or(String::new(), |u| u.describe())
                    )));
                }
                s.upper = Some(up);
                s.budget = budget;
            }
            None => {
                if let Some(name) = s.held.keys().next() {
                    return Err(io::Error::other(format!(
                        "{} files are still held in the cache directory (first {name}); \
                         they must be moved down before it is detached",
                        s.held.len()
                    )));
                }
                s.upper = None;
                s.budget = 0;
            }
        }
        Ok(())
    }

    fn hold_no_new(&self) {
        lock(&self.stage).budget = 0;
    }

    fn held(&self) -> io::Result<Vec<(String, u64)>> {
        let s = lock(&self.stage);
        s.held
            .iter()
            .map(|(n, f)| Ok((n.clone(), f.len()?)))
            .collect()
    }

    fn move_down(&self, name: &str) -> io::Result<bool> {
        let (file, up) = {
            let mut s = lock(&self.stage);
            if s.moving.is_some() {
                return Ok(false);
            }
            let (Some(f), Some(up)) = (s.held.get(name).cloned(), s.upper.clone()) else {
                return Ok(false);
            };
            s.moving = Some((name.to_string(), false));
            (f, up)
        };
        let copied = self.copy_down(name, &*file.now());
        let mut s = lock(&self.stage);
        let removed = s.moving.take().is_some_and(|(_, removed)| removed);
        let to = match copied {
            Ok(to) => to,
            Err(e) => {
                drop(s);
                // Best effort: the next writable open removes a partial copy too.
                let _ = self.lower.remove(&format!("{name}{PARTIAL_SUFFIX}"));
                return Err(e);
            }
        };
        if removed {
            // Removed while it was copied (GC): so is its copy.
            drop(s);
            self.lower.remove(name)?;
            self.lower.sync_dir()?;
            return Ok(false);
        }
        file.point_to(to);
        s.held.remove(name);
        drop(s);
        self.upper_changed.store(true, Ordering::SeqCst);
        up.remove(name).map_err(|e| in_dir(&*up, e))?;
        up.sync_dir().map_err(|e| in_dir(&*up, e))?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::{SimDir, SimHandle};

    fn dirs() -> (Arc<dyn Dir>, Arc<dyn Dir>) {
        (
            Arc::new(SimHandle(SimDir::new())),
            Arc::new(SimHandle(SimDir::new())),
        )
    }

    #[test]
    fn places_new_files_by_kind_and_budget() -> io::Result<()> {
        let (lower, upper) = dirs();
        let st = Staging::compose(lower.clone(), Some(upper.clone()), 4096)?;
        let seg = st.open("seg-00000000.dat", true)?;
        seg.write_at(&[1u8; 4096], 0)?;
        // Over the budget: the next segment goes down.
        st.open("seg-00000001.dat", true)?;
        st.open("journal-0000000000000001.wal", true)?;
        st.open("meta.dat", true)?;
        assert!(upper.exists("seg-00000000.dat")? && !lower.exists("seg-00000000.dat")?);
        assert!(lower.exists("seg-00000001.dat")? && !upper.exists("seg-00000001.dat")?);
        assert!(upper.exists("journal-0000000000000001.wal")?);
        assert!(lower.exists("meta.dat")? && !upper.exists("meta.dat")?);
        let names: Vec<String> = st.held()?.into_iter().map(|(n, _)| n).collect();
        assert_eq!(
            names,
            ["journal-0000000000000001.wal", "seg-00000000.dat"].map(String::from)
        );
        assert_eq!(
            st.list("seg-")?,
            ["seg-00000000.dat", "seg-00000001.dat"].map(String::from)
        );
        // Budget 0 (draining): nothing new is held, journals included.
        st.hold_no_new();
        st.open("journal-0000000000000002.wal", true)?;
        assert!(lower.exists("journal-0000000000000002.wal")?);
        // Cannot stop holding while something is held.
        assert!(st.hold_in(None).is_err());
        Ok(())
    }

    #[test]
    fn move_down_repoints_open_handles_and_removes_the_held_copy() -> io::Result<()> {
        let (lower, upper) = dirs();
        let st = Staging::compose(lower.clone(), Some(upper.clone()), 1 << 20)?;
        let f = st.open("seg-00000003.dat", true)?;
        f.write_at(b"sealed bytes", 0)?;
        assert!(st.move_down("seg-00000003.dat")?);
        assert!(!upper.exists("seg-00000003.dat")?);
        assert!(lower.exists("seg-00000003.dat")?);
        assert!(!lower.exists("seg-00000003.dat.partial")?);
        let mut back = [0u8; 12];
        f.read_at(&mut back, 0)?;
        assert_eq!(&back, b"sealed bytes");
        assert!(st.held()?.is_empty());
        // Not held any more: nothing to move; and the layer may stop holding.
        assert!(!st.move_down("seg-00000003.dat")?);
        st.hold_in(None)?;
        Ok(())
    }

    #[test]
    fn a_segment_in_both_directories_is_the_lower_copy() -> io::Result<()> {
        let (lower, upper) = dirs();
        upper
            .open("seg-00000005.dat", true)?
            .write_at(b"staged", 0)?;
        lower
            .open("seg-00000005.dat", true)?
            .write_at(b"destaged", 0)?;
        upper
            .open("seg-00000006.dat", true)?
            .write_at(b"only up", 0)?;
        let st = Staging::compose(lower.clone(), Some(upper.clone()), 1 << 20)?;
        let names: Vec<String> = st.held()?.into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["seg-00000006.dat".to_string()]);
        let mut b = [0u8; 8];
        st.open("seg-00000005.dat", false)?.read_at(&mut b, 0)?;
        assert_eq!(&b, b"destaged");
        assert!(upper.exists("seg-00000005.dat")?);
        st.remove_shadowed()?;
        assert!(!upper.exists("seg-00000005.dat")?);
        assert!(upper.exists("seg-00000006.dat")?);
        Ok(())
    }

    #[test]
    fn a_removal_during_a_move_is_told_to_it() -> io::Result<()> {
        let (lower, upper) = dirs();
        let st = Staging::compose(lower.clone(), Some(upper.clone()), 1 << 20)?;
        st.open("seg-00000007.dat", true)?.write_at(b"x", 0)?;
        // What GC's removal does while a move copies the file (the copy step in between).
        lock(&st.stage).moving = Some(("seg-00000007.dat".into(), false));
        st.remove("seg-00000007.dat")?;
        assert_eq!(
            lock(&st.stage).moving,
            Some(("seg-00000007.dat".to_string(), true))
        );
        lock(&st.stage).moving = None;
        assert!(!upper.exists("seg-00000007.dat")? && !lower.exists("seg-00000007.dat")?);
        assert!(!st.move_down("seg-00000007.dat")?);
        Ok(())
    }
}

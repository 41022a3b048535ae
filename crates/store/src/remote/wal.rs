//! The write-ahead objects of `--durability remote` ([`WalDir`]): each sync of a journal or
//! staged segment file in the local directory uploads the bytes written since the last one
//! as `gen/E-W/wal/SEQ` (this writer's generation), and an open rebuilds missing local files
//! from the write-ahead objects in its view (the newest root's manifest names those of earlier
//! writers still needed; its writer's own come from the listing), oldest writer first.
//!
//! Invariants:
//! - A sync of a logged file returns only after its write-ahead object is in the bucket; a
//!   failed upload leaves the file's bytes queued, logged before anything else by the next
//!   sync of any file.
//! - Only journal and segment files are logged, and a write-ahead object naming anything
//!   else (a path, a hidden name) is refused when read.
//! - Removing a file deletes its write-ahead objects (best effort).

use super::conf::remote_error;
use super::shared::Shared;
use crate::io::{Dir, File, RealDir};
use condense_format::bucket::{parse_object, wal_object, ObjectKind};
use condense_format::error::{Error, Result};
use condense_format::remote::is_logged;
pub use condense_format::remote::{decode_wal, encode_wal};
use condense_format::Durability;
use std::collections::{BTreeSet, HashMap};
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

/// The local directory of a `remote`-durability pool: a real directory whose journal and
/// segment files also upload, at each sync, what was written to them since the last one.
///
/// Whether a file logs its syncs is decided when it is opened, by the pool's durability then
/// (a change of durability is followed by a checkpoint, which replaces the journal and seals
/// the open segment). With `local` durability the directory still rebuilds files from
/// write-ahead objects another open left, and deletes them with their files.
pub struct WalDir {
    local: Arc<RealDir>,
    log: Arc<WalLog>,
}

/// The write-ahead objects written so far, shared by a [`WalDir`] and its files.
struct WalLog {
    shared: Arc<Shared>,
    next_seq: AtomicU64,
    /// The write-ahead objects of each file, so that removing the file deletes them.
    by_file: Mutex<HashMap<String, Vec<String>>>,
    /// Files synced locally whose bytes a failed upload left unlogged: every later sync of
    /// any file logs them first (a flush that failed so is retried by the next flush, which
    /// may not sync those segment files again), in order, before its own bytes.
    unlogged: Mutex<Vec<Arc<WalFile>>>,
}

impl WalLog {
    /// Log what earlier failed syncs left unlogged.
    fn retry_unlogged(&self) -> io::Result<()> {
        let files = std::mem::take(&mut *self.unlogged.lock().unwrap_or_else(|e| e.into_inner()));
        for (i, f) in files.iter().enumerate() {
            if let Err(e) = f.log_dirty() {
                self.unlogged
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .extend(files[i..].iter().cloned());
                return Err(e);
            }
        }
        Ok(())
    }

    fn append(&self, name: &str, offset: u64, data: &[u8]) -> io::Result<()> {
        let gen = self.shared.names.generation().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("logging {name}: this open does not write the pool"),
            )
        })?;
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let obj = wal_object(gen, seq);
        self.shared.put(&obj, &encode_wal(name, offset, data))?;
        self.shared.names.add_wal(&obj);
        self.by_file
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(name.to_string())
            .or_default()
            .push(obj);
        Ok(())
    }
}

impl WalDir {
    /// The local directory `local` of the pool whose bucket side is `shared`, with no
    /// write-ahead object known yet ([`WalDir::recover`] finds them).
    pub(super) fn new(local: Arc<RealDir>, shared: Arc<Shared>) -> WalDir {
        WalDir {
            local,
            log: Arc::new(WalLog {
                shared,
                next_seq: AtomicU64::new(0),
                by_file: Mutex::new(HashMap::new()),
                unlogged: Mutex::new(Vec::new()),
            }),
        }
    }

    /// Rebuild the journal and staged segment files missing from the local directory from
    /// the bucket's write-ahead objects (a new host, a lost local disk). Returns how many
    /// files were rebuilt.
    pub(super) fn recover(&self) -> Result<usize> {
        let url = &self.log.shared.url;
        let store = &self.log.shared.store;
        // Oldest writer first, each in its own order.
        let mut objects: Vec<(condense_format::bucket::Generation, u64, String)> = self
            .log
            .shared
            .names
            .wal_objects()
            .into_iter()
            .filter_map(|o| match parse_object(&o) {
                Some(ObjectKind::Wal { gen, seq }) => Some((gen, seq, o)),
                _ => None,
            })
            .collect();
        objects.sort();
        let present: BTreeSet<String> = self
            .local
            .list("")
            .map_err(|e| Error::io("listing the local directory", e))?
            .into_iter()
            .collect();
        let mut rebuilt: HashMap<String, Arc<dyn File>> = HashMap::new();
        for (_, _, obj) in &objects {
            let bytes = store.get(obj).map_err(|e| remote_error(url, e))?;
            let (name, offset, data) = decode_wal(&bytes)
                .ok_or_else(|| Error::corrupt(format!("{url} {obj}"), "bad write-ahead object"))?;
            self.log
                .by_file
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .entry(name.clone())
                .or_default()
                .push(obj.clone());
            if present.contains(&name) {
                continue;
            }
            let file = match rebuilt.get(&name) {
                Some(f) => f.clone(),
                None => {
                    let f = self
                        .local
                        .open(&name, true)
                        .and_then(|f| f.set_len(0).map(|_| f))
                        .map_err(|e| Error::io(format!("rebuilding {name}"), e))?;
                    rebuilt.insert(name.clone(), f.clone());
                    f
                }
            };
            file.write_at(data, offset)
                .map_err(|e| Error::io(format!("rebuilding {name}"), e))?;
        }
        for (name, f) in &rebuilt {
            f.sync()
                .map_err(|e| Error::io(format!("syncing rebuilt {name}"), e))?;
        }
        self.local
            .sync_dir()
            .map_err(|e| Error::io("syncing the local directory", e))?;
        if !rebuilt.is_empty() {
            let mut names: Vec<_> = rebuilt.keys().cloned().collect();
            names.sort();
            tracing::warn!(
                "rebuilt {} files of the local directory from {url}'s write-ahead objects: {}",
                names.len(),
                names.join(", ")
            );
        }
        Ok(rebuilt.len())
    }
}

impl Dir for WalDir {
    fn open(&self, name: &str, create: bool) -> io::Result<Arc<dyn File>> {
        let file = self.local.open(name, create)?;
        // A read-only open never writes the bucket: a file it restores locally (an empty
        // journal) is not logged.
        let logs = self.log.shared.durability() == Durability::Remote && !self.log.shared.read_only;
        if !logs || !is_logged(name) {
            return Ok(file);
        }
        Ok(Arc::new_cyclic(|me| WalFile {
            file,
            name: name.to_string(),
            dirty: Mutex::new(None),
            log: self.log.clone(),
            me: me.clone(),
        }))
    }
    fn exists(&self, name: &str) -> io::Result<bool> {
        self.local.exists(name)
    }
    fn remove(&self, name: &str) -> io::Result<()> {
        self.local.remove(name)?;
        let objs = self
            .log
            .by_file
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name)
            .unwrap_or_default();
        for o in objs {
            // Best effort: a write-ahead object left behind rebuilds a file the next open
            // removes again (an old journal generation, a segment already uploaded).
            self.log.shared.names.forget_wal(&o);
            if let Err(e) = self.log.shared.delete(&o) {
                tracing::warn!("deleting {o}: {e}");
            }
        }
        Ok(())
    }
    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        self.local.rename(from, to)
    }
    fn list(&self, prefix: &str) -> io::Result<Vec<String>> {
        self.local.list(prefix)
    }
    fn sync_dir(&self) -> io::Result<()> {
        self.local.sync_dir()
    }
    fn total_bytes(&self) -> io::Result<u64> {
        self.local.total_bytes()
    }
    fn available_bytes(&self) -> io::Result<u64> {
        self.local.available_bytes()
    }
    fn scratch_file(&self) -> io::Result<Option<Arc<dyn File>>> {
        self.local.scratch_file()
    }
    fn describe(&self) -> String {
        self.local.describe()
    }
}

/// A journal or segment file of a [`WalDir`].
struct WalFile {
    file: Arc<dyn File>,
    name: String,
    /// Bytes written since the last sync: [start, end).
    dirty: Mutex<Option<(u64, u64)>>,
    log: Arc<WalLog>,
    me: Weak<WalFile>,
}

impl WalFile {
    /// Upload the bytes written since the last logged sync as one write-ahead object.
    fn log_dirty(&self) -> io::Result<()> {
        let range = *self.dirty.lock().unwrap_or_else(|e| e.into_inner());
        let Some((start, end)) = range else {
            return Ok(());
        };
        let end = end.min(self.file.len()?);
        if end > start {
            let mut buf = vec![0u8; (end - start) as usize];
            self.file.read_at(&mut buf, start)?;
            self.log.append(&self.name, start, &buf)?;
        }
        // Writes that raced with this sync extended the range; they are logged by the next.
        let mut d = self.dirty.lock().unwrap_or_else(|e| e.into_inner());
        if *d == range {
            *d = None;
        } else if let Some((s, e)) = *d {
            *d = Some((s.max(end).min(e), e));
        }
        Ok(())
    }
}

impl File for WalFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.file.read_at(buf, offset)
    }
    fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        self.file.write_at(data, offset)?;
        let end = offset + data.len() as u64;
        let mut d = self.dirty.lock().unwrap_or_else(|e| e.into_inner());
        *d = Some(match *d {
            Some((s, e)) => (s.min(offset), e.max(end)),
            None => (offset, end),
        });
        Ok(())
    }
    fn len(&self) -> io::Result<u64> {
        self.file.len()
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.file.set_len(len)
    }
    fn sync(&self) -> io::Result<()> {
        self.file.sync()?;
        let logged = self.log.retry_unlogged().and_then(|_| self.log_dirty());
        if logged.is_err() {
            if let Some(me) = self.me.upgrade() {
                let mut u = self.log.unlogged.lock().unwrap_or_else(|e| e.into_inner());
                if !u.iter().any(|f| Arc::ptr_eq(f, &me)) {
                    u.push(me);
                }
            }
        }
        logged
    }
}

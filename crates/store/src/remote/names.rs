//! Which object of the bucket each pool file is ([`Names`]): the view an open loads from the
//! newest checkpoint root and its manifest, the names of what this writer uploads, and the
//! deletion of what no root needs any more (docs/S3.md "Objects never replaced").
//!
//! Invariants:
//! - **No object is ever put twice.** Every upload of this writer is named by its generation
//!   and a sequence number that only grows ([`condense_format::bucket::gen_object`]).
//! - **The view is the newest root's.** An open trusts the root of the generation trusted
//!   over every other that has one (higher epoch; [`Generation::trusted_over`]), that root's
//!   manifest, and the objects that generation uploaded after it (segments and write-ahead
//!   objects a crashed writer left: the journal it wrote may name them).
//! - **A root's manifest is in the bucket before the root**, and names only objects already
//!   there: the manifest lists this view, and every file in the view was uploaded (or found)
//!   before.
//! - **An object leaves the bucket one root after it left the view**: replaced versions and
//!   a previous generation's leftovers are deleted when the second root after it is put, so
//!   a reader that opened the previous root finds its objects for one checkpoint interval.
//!   A removed file (a segment GC emptied, an old journal) is deleted at once, as in a
//!   local pool.

use super::conf::remote_error;
use super::parallel::in_parallel;
use condense_format::bucket::{
    gen_object, manifest_object, parse_object, Generation, Manifest, ObjectKind,
    MAX_MANIFEST_BYTES, ROOT_NAME,
};
use condense_format::error::{Error, Result};
use condense_object_store::ObjectBackend;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io;
use std::sync::Mutex;

/// What the view needs of the open to change the bucket (the open's `Shared` implements it):
/// the write-gated PUT and DELETE, and a read.
pub(super) trait Bucket: Sync {
    /// The pool's URL, for messages.
    fn url(&self) -> &str;
    /// Put a new object, if this open may write now.
    fn put(&self, name: &str, bytes: &[u8]) -> io::Result<()>;
    /// Delete an object, if this open may write now.
    fn delete(&self, name: &str) -> io::Result<()>;
    /// Read a whole object.
    fn get(&self, name: &str) -> std::result::Result<Vec<u8>, condense_object_store::Error>;
}

/// The view of one open, shared by the directory, its files and the write-ahead log.
#[derive(Default)]
pub(super) struct Names {
    state: Mutex<View>,
}

/// Pool files and write-ahead objects as this open sees them.
#[derive(Default)]
pub(super) struct View {
    /// This open's generation (a writer), or `None` (a reader: never uploads).
    gen: Option<Generation>,
    /// Pool file → (object, bytes).
    files: BTreeMap<String, (String, u64)>,
    /// The manifest of the root in the view, if it is a generation's.
    manifest: Option<String>,
    wal: BTreeSet<String>,
    next_seq: u64,
    /// Objects that left the view since the last root put by this writer.
    superseded: Vec<String>,
    /// Objects that left the view before the last root: deleted after the next one.
    due: Vec<String>,
    /// The highest epoch of any generation with objects in the bucket.
    pub max_epoch: u64,
}

/// One object of a listing, by kind.
struct Listed {
    files: BTreeMap<Generation, Vec<(u64, String, String, u64)>>,
    manifests: HashMap<(Generation, u64), u64>,
    wal: BTreeMap<Generation, BTreeSet<String>>,
    all: Vec<String>,
}

fn sort_listing(all: Vec<(String, u64)>) -> Listed {
    let mut l = Listed {
        files: BTreeMap::new(),
        manifests: HashMap::new(),
        wal: BTreeMap::new(),
        all: Vec::new(),
    };
    for (obj, size) in all {
        match parse_object(&obj) {
            Some(ObjectKind::File { gen, name, seq }) => {
                l.files
                    .entry(gen)
                    .or_default()
                    .push((seq, name, obj.clone(), size));
            }
            Some(ObjectKind::Manifest { gen, seq }) => {
                l.manifests.insert((gen, seq), size);
            }
            Some(ObjectKind::Wal { gen, .. }) => {
                l.wal.entry(gen).or_default().insert(obj.clone());
            }
            Some(ObjectKind::Claim { .. } | ObjectKind::LegacyLease) | None => continue,
        }
        l.all.push(obj);
    }
    for v in l.files.values_mut() {
        v.sort();
    }
    l
}

impl Listed {
    /// The highest epoch of any generation with objects listed.
    fn max_epoch(&self) -> u64 {
        self.files
            .keys()
            .chain(self.wal.keys())
            .map(|g| g.epoch)
            .max()
            .unwrap_or(0)
    }
}

/// The highest epoch of any generation with objects in the bucket (one LIST).
pub(super) fn max_epoch(store: &dyn ObjectBackend, url: &str) -> Result<u64> {
    Ok(sort_listing(store.list("").map_err(|e| remote_error(url, e))?).max_epoch())
}

impl View {
    /// The view of the bucket `store` holds now (one LIST, one GET of the newest manifest).
    pub(super) fn load(store: &dyn ObjectBackend, url: &str) -> Result<View> {
        let listed = sort_listing(store.list("").map_err(|e| remote_error(url, e))?);
        let mut v = View {
            max_epoch: listed.max_epoch(),
            ..View::default()
        };
        // The newest root: of the generations with a root (a checkpoint with its manifest),
        // the trusted one, and its last root.
        let mut best: Option<(Generation, u64, String, u64)> = None;
        for (g, files) in &listed.files {
            for (seq, name, obj, size) in files {
                let is_root = *g != Generation::LEGACY
                    && name == ROOT_NAME
                    && listed.manifests.contains_key(&(*g, *seq));
                let newer = match &best {
                    None => true,
                    Some((bg, bs, ..)) => g.trusted_over(bg) || (g == bg && seq > bs),
                };
                if is_root && newer {
                    best = Some((*g, *seq, obj.clone(), *size));
                }
            }
        }
        if let Some((g, seq, root, size)) = best {
            let mobj = manifest_object(g, seq);
            let msize = listed.manifests.get(&(g, seq)).copied().unwrap_or(0);
            if msize > MAX_MANIFEST_BYTES {
                return Err(Error::corrupt(
                    format!("{url} {mobj}"),
                    format!("{msize} bytes, more than a manifest can be"),
                ));
            }
            let bytes = store.get(&mobj).map_err(|e| remote_error(url, e))?;
            let m = Manifest::decode(&format!("{url} {mobj}"), &bytes)?;
            v.files = m.files;
            v.wal = m.wal;
            v.files.insert(ROOT_NAME.to_string(), (root, size));
            // What the root's writer uploaded after it (a crash before its next root).
            for (s, name, obj, size) in listed.files.get(&g).into_iter().flatten() {
                if *s > seq && name != ROOT_NAME {
                    v.files.insert(name.clone(), (obj.clone(), *size));
                }
            }
            v.wal
                .extend(listed.wal.get(&g).into_iter().flatten().cloned());
            v.manifest = Some(mobj);
        } else if let Some(legacy) = listed.files.get(&Generation::LEGACY) {
            // A pool made before generations: objects named as its files.
            for (_, name, obj, size) in legacy {
                v.files.insert(name.clone(), (obj.clone(), *size));
            }
            v.wal = listed
                .wal
                .get(&Generation::LEGACY)
                .cloned()
                .unwrap_or_default();
        } else if let Some(g) =
            listed
                .files
                .keys()
                .copied()
                .reduce(|a, b| if b.trusted_over(&a) { b } else { a })
        {
            // No root yet: a pool being made (init writes its superblock first).
            for (_, name, obj, size) in &listed.files[&g] {
                v.files.insert(name.clone(), (obj.clone(), *size));
            }
        }
        // A file or write-ahead object its writer removed after the root (an emptied segment,
        // an old journal) is not in the view.
        let present: BTreeSet<&String> = listed.all.iter().collect();
        v.files.retain(|_, (o, _)| present.contains(o));
        v.wal.retain(|o| present.contains(o));
        // Everything else of the pool's is garbage once a writer holds the lease.
        let keep: BTreeSet<&String> = v
            .files
            .values()
            .map(|(o, _)| o)
            .chain(v.wal.iter())
            .chain(v.manifest.iter())
            .collect();
        v.superseded = listed
            .all
            .iter()
            .filter(|o| !keep.contains(o))
            .cloned()
            .collect();
        Ok(v)
    }
}

impl View {
    /// The object and size of pool file `name` in this view.
    pub(super) fn object(&self, name: &str) -> Option<(String, u64)> {
        self.files.get(name).cloned()
    }

    pub(super) fn files(self) -> BTreeMap<String, (String, u64)> {
        self.files
    }
}

impl Names {
    pub(super) fn install(&self, v: View) {
        *self.lock() = v;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, View> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The generation this open writes as.
    pub(super) fn generation(&self) -> Option<Generation> {
        self.lock().gen
    }

    /// The object and size of pool file `name`.
    pub(super) fn object(&self, name: &str) -> Option<(String, u64)> {
        self.lock().files.get(name).cloned()
    }

    /// Pool files whose names start with `prefix` (the top level: no `meta/` extents).
    pub(super) fn list(&self, prefix: &str) -> Vec<(String, u64)> {
        self.lock()
            .files
            .iter()
            .filter(|(n, _)| n.starts_with(prefix) && !n.contains('/'))
            .map(|(n, (_, size))| (n.clone(), *size))
            .collect()
    }

    /// The `meta.dat` extents: (extent number, object, bytes).
    pub(super) fn extents(&self) -> Vec<(u64, String, u64)> {
        self.lock()
            .files
            .iter()
            .filter_map(|(n, (o, b))| {
                let x = n.strip_prefix("meta/")?;
                Some((u64::from_str_radix(x, 16).ok()?, o.clone(), *b))
            })
            .collect()
    }

    pub(super) fn wal_objects(&self) -> Vec<String> {
        self.lock().wal.iter().cloned().collect()
    }

    pub(super) fn add_wal(&self, obj: &str) {
        self.lock().wal.insert(obj.to_string());
    }

    pub(super) fn forget_wal(&self, obj: &str) {
        self.lock().wal.remove(obj);
    }

    /// A new object name of this writer for pool file `name`.
    fn next_object(&self, name: &str) -> io::Result<String> {
        let mut v = self.lock();
        let gen = v.gen.ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("uploading {name}: this open does not write the pool"),
            )
        })?;
        v.next_seq += 1;
        Ok(gen_object(gen, name, v.next_seq))
    }

    /// Upload `bytes` as pool file `name` (a new object); returns the object.
    pub(super) fn put_file(
        &self,
        shared: &dyn Bucket,
        name: &str,
        bytes: &[u8],
    ) -> io::Result<String> {
        let obj = self.next_object(name)?;
        shared.put(&obj, bytes)?;
        let mut v = self.lock();
        if let Some((old, _)) = v
            .files
            .insert(name.to_string(), (obj.clone(), bytes.len() as u64))
        {
            v.superseded.push(old);
        }
        Ok(obj)
    }

    /// Put a checkpoint root: its manifest (this view), then the root; then delete what left
    /// the view before the previous root.
    pub(super) fn put_root(&self, shared: &dyn Bucket, root: &[u8]) -> io::Result<String> {
        let (gen, seq, manifest) = {
            let mut v = self.lock();
            let gen = v.gen.ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    "putting a checkpoint root: this open does not write the pool",
                )
            })?;
            v.next_seq += 1;
            let mut m = Manifest {
                files: v.files.clone(),
                wal: v.wal.clone(),
            };
            m.files.remove(ROOT_NAME);
            (gen, v.next_seq, m.encode())
        };
        let mobj = manifest_object(gen, seq);
        shared.put(&mobj, &manifest)?;
        let obj = gen_object(gen, ROOT_NAME, seq);
        shared.put(&obj, root)?;
        let due = {
            let mut v = self.lock();
            if let Some((old, _)) = v
                .files
                .insert(ROOT_NAME.to_string(), (obj.clone(), root.len() as u64))
            {
                v.superseded.push(old);
            }
            if let Some(old) = v.manifest.replace(mobj) {
                v.superseded.push(old);
            }
            let next = std::mem::take(&mut v.superseded);
            std::mem::replace(&mut v.due, next)
        };
        // Eight at a time: a checkpoint after a large import replaced many extents.
        for (o, r) in due.iter().zip(in_parallel(&due, |o| shared.delete(o))) {
            if let Err(e) = r {
                tracing::warn!("deleting {o} (no root needs it): {e}");
            }
        }
        Ok(obj)
    }

    /// Remove pool file `name`: its object is deleted now.
    pub(super) fn remove_file(&self, shared: &dyn Bucket, name: &str) -> io::Result<()> {
        let Some((obj, _)) = self.lock().files.remove(name) else {
            return Ok(());
        };
        shared.delete(&obj)
    }

    /// Start writing as `gen`: put a first root of this generation (the view's root again,
    /// with a manifest of this view), so every reader trusts this generation from now on
    /// and nothing the previous writer left after its last root is lost.
    pub(super) fn begin(&self, shared: &dyn Bucket, gen: Generation) -> Result<()> {
        let root = {
            let mut v = self.lock();
            v.gen = Some(gen);
            v.files.get(ROOT_NAME).cloned()
        };
        let Some((obj, _)) = root else {
            return Ok(()); // init: the pool's first root comes with its first checkpoint
        };
        let bytes = shared
            .get(&obj)
            .map_err(|e| remote_error(shared.url(), e))?;
        self.put_root(shared, &bytes).map_err(|e| {
            Error::io(
                format!("putting the first root of this writer in {}", shared.url()),
                e,
            )
        })?;
        Ok(())
    }
}

//! The file types of [`super::RemoteDir`]: [`ObjFile`] (an object read in place),
//! [`BufFile`] (a file written whole in memory, uploaded by its sync or its rename) and
//! [`MetaFile`] (`meta.dat`: the local mirror, uploaded by extents).
//!
//! Invariants:
//! - An object, once stored, is never written again through these files: writes to an
//!   [`ObjFile`] or a stored [`BufFile`] are refused, and every upload is a new object
//!   ([`super::names::Names`]).
//! - A `meta.dat` extent stays dirty until its upload succeeded.
//! - A page that fails its check in the mirror is read again from the bucket's extent and
//!   the mirror mended ([`MetaFile`]'s `read_other_copy`).

use super::parallel::in_parallel;
use super::shared::Shared;
use crate::io::File;
use std::collections::BTreeSet;
use std::io;
use std::sync::{Arc, Mutex};

/// Bytes of one `meta.dat` extent object.
pub const META_EXTENT_BYTES: u64 = 256 << 10;

/// An object read in place (a destaged segment, the superblock, a checkpoint root).
pub(super) struct ObjFile {
    pub(super) shared: Arc<Shared>,
    pub(super) name: String,
    pub(super) len: u64,
}

fn read_only_object(name: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::Unsupported,
        format!("object {name} is immutable"),
    )
}

impl File for ObjFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.shared.read(&self.name, self.len, buf, offset)
    }
    fn write_at(&self, _: &[u8], _: u64) -> io::Result<()> {
        Err(read_only_object(&self.name))
    }
    fn len(&self) -> io::Result<u64> {
        Ok(self.len)
    }
    fn set_len(&self, _: u64) -> io::Result<()> {
        Err(read_only_object(&self.name))
    }
    fn sync(&self) -> io::Result<()> {
        Ok(())
    }
    fn will_need(&self, offset: u64, len: u64) {
        self.shared.will_need(&self.name, self.len, offset, len)
    }
}

pub(super) enum BufState {
    Writing(Vec<u8>),
    /// Uploaded as this object, with this length; read in place from now on.
    Stored(String, u64),
}

/// A file written whole in memory and uploaded by `sync` (its own name) or by `rename`.
pub(super) struct BufFile {
    pub(super) shared: Arc<Shared>,
    pub(super) name: String,
    pub(super) state: Mutex<BufState>,
}

impl BufFile {
    /// Upload the buffer as `to`; the file reads that object from now on. Returns the bytes.
    pub(super) fn store_as(&self, to: &str) -> io::Result<Vec<u8>> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let bytes = match &mut *st {
            BufState::Writing(b) => std::mem::take(b),
            BufState::Stored(n, _) => {
                return Err(io::Error::other(format!(
                    "{} was already uploaded as {n}",
                    self.name
                )))
            }
        };
        let names = &self.shared.names;
        let put = if to == condense_format::bucket::ROOT_NAME {
            names.put_root(&*self.shared, &bytes)
        } else {
            names.put_file(&*self.shared, to, &bytes)
        };
        match put {
            Ok(obj) => {
                *st = BufState::Stored(obj, bytes.len() as u64);
                Ok(bytes)
            }
            Err(e) => {
                *st = BufState::Writing(bytes);
                Err(e)
            }
        }
    }

    fn is_temporary(&self) -> bool {
        self.name.ends_with(".tmp") || self.name.ends_with(condense_format::PARTIAL_SUFFIX)
    }
}

impl File for BufFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match &*st {
            BufState::Writing(b) => {
                let end = offset as usize + buf.len();
                if end > b.len() {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!("read past the end of {}", self.name),
                    ));
                }
                buf.copy_from_slice(&b[offset as usize..end]);
                Ok(())
            }
            BufState::Stored(n, len) => {
                let (n, len) = (n.clone(), *len);
                drop(st);
                self.shared.read(&n, len, buf, offset)
            }
        }
    }
    fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let BufState::Writing(b) = &mut *st else {
            return Err(read_only_object(&self.name));
        };
        let end = offset as usize + data.len();
        if b.len() < end {
            b.resize(end, 0);
        }
        b[offset as usize..end].copy_from_slice(data);
        Ok(())
    }
    fn len(&self) -> io::Result<u64> {
        Ok(
            match &*self.state.lock().unwrap_or_else(|e| e.into_inner()) {
                BufState::Writing(b) => b.len() as u64,
                BufState::Stored(_, len) => *len,
            },
        )
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let BufState::Writing(b) = &mut *st else {
            return Err(read_only_object(&self.name));
        };
        b.resize(len as usize, 0);
        Ok(())
    }
    fn sync(&self) -> io::Result<()> {
        if self.is_temporary() {
            // Made durable by the rename that follows (a PUT).
            return Ok(());
        }
        let bytes = match &*self.state.lock().unwrap_or_else(|e| e.into_inner()) {
            BufState::Writing(b) => b.clone(),
            BufState::Stored(..) => return Ok(()),
        };
        self.shared
            .names
            .put_file(&*self.shared, &self.name, &bytes)
            .map(|_| ())
    }
    fn will_need(&self, offset: u64, len: u64) {
        let stored = match &*self.state.lock().unwrap_or_else(|e| e.into_inner()) {
            BufState::Stored(n, len) => Some((n.clone(), *len)),
            BufState::Writing(_) => None,
        };
        if let Some((n, size)) = stored {
            self.shared.will_need(&n, size, offset, len);
        }
    }
}

/// `meta.dat`: a local mirror; a sync uploads the extents written since the last sync.
pub(super) struct MetaFile {
    pub(super) local: Arc<dyn File>,
    pub(super) dirty: Mutex<BTreeSet<u64>>,
    pub(super) shared: Arc<Shared>,
}

impl File for MetaFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.local.read_at(buf, offset)
    }
    /// The bucket's extent objects hold every page the bucket's root names, whatever the
    /// mirror's disk did to them; a page written since the last upload is only in the mirror
    /// (the bucket's older bytes then fail the caller's check too, as they should).
    fn read_other_copy(&self, buf: &mut [u8], offset: u64) -> io::Result<bool> {
        let end = offset + buf.len() as u64;
        let mut at = offset;
        while at < end {
            let e = at / META_EXTENT_BYTES;
            let ext_start = e * META_EXTENT_BYTES;
            let ext_end = (ext_start + META_EXTENT_BYTES).min(end);
            let name = format!("meta/{e:08x}");
            let Some((obj, _)) = self.shared.names.object(&name) else {
                return Ok(false); // never uploaded: the mirror is the only copy
            };
            let obj = self.shared.note(self.shared.store.get(&obj))?;
            let (from, to) = ((at - ext_start) as usize, (ext_end - ext_start) as usize);
            let got = obj.get(from..to).ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("meta/{e:08x} is shorter than {to} bytes"),
                )
            })?;
            let dst = (at - offset) as usize;
            buf[dst..dst + got.len()].copy_from_slice(got);
            at = ext_end;
        }
        // Mend the mirror (the bucket has these bytes already: nothing to upload).
        if let Err(e) = self.local.write_at(buf, offset) {
            tracing::warn!("could not mend meta.dat at {offset}: {e}");
        }
        Ok(true)
    }
    fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        self.shared.may_write_local("writing meta.dat")?;
        self.local.write_at(data, offset)?;
        let mut d = self.dirty.lock().unwrap_or_else(|e| e.into_inner());
        let last = (offset + data.len().max(1) as u64 - 1) / META_EXTENT_BYTES;
        d.extend(offset / META_EXTENT_BYTES..=last);
        Ok(())
    }
    fn len(&self) -> io::Result<u64> {
        self.local.len()
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.local.set_len(len)
    }
    fn sync(&self) -> io::Result<()> {
        self.local.sync()?;
        let extents: Vec<u64> = self
            .dirty
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .copied()
            .collect();
        if extents.is_empty() {
            return Ok(());
        }
        let file_len = self.local.len()?;
        let uploaded = in_parallel(&extents, |&e| {
            let start = e * META_EXTENT_BYTES;
            let len = META_EXTENT_BYTES.min(file_len.saturating_sub(start));
            let mut buf = vec![0u8; len as usize];
            self.local
                .read_at(&mut buf, start)
                .and_then(|_| {
                    let name = format!("meta/{e:08x}");
                    self.shared.names.put_file(&*self.shared, &name, &buf)
                })
                .map(|_| ())
        });
        // An extent stays dirty until its upload succeeded.
        let mut d = self.dirty.lock().unwrap_or_else(|e| e.into_inner());
        let mut failed = None;
        for (e, r) in extents.iter().zip(uploaded) {
            match r {
                Ok(()) => {
                    d.remove(e);
                }
                Err(err) => failed = Some(err),
            }
        }
        failed.map_or(Ok(()), Err)
    }
}

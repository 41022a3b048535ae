//! [`LocalBackend`]: objects as files in a directory (tests, and a pool whose "bucket" is a
//! mounted file system).
//!
//! `put` writes `.tmp-NONCE` beside the final name, fsyncs it, renames it into place and
//! fsyncs the directory, so an object is whole or absent after a crash (invariant 1).
//! `put_if_absent` replaces the rename by `link(2)`, which fails if the name exists: the file
//! system enforces it, so [`ObjectBackend::conditional_put_honoured`] is `true`. A `/` in a
//! name is a subdirectory. Files whose names start with `.` (temporaries a crash left behind)
//! are never listed.
//!
//! The objects are a pool's data: files are created 0600 and missing directories 0700,
//! whatever the umask (as in a local pool, docs/SECURITY.md).

use crate::error::{Error, Op, Result, SizeText};
use crate::{nonce, under, validate_name, validate_prefix, BackendStats, Counters, ObjectBackend};
use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// A directory of objects.
#[derive(Debug)]
pub struct LocalBackend {
    root: PathBuf,
    stats: Counters,
}

impl LocalBackend {
    /// Use `root` (created if missing) as the store.
    pub fn open(root: impl AsRef<Path>) -> Result<LocalBackend> {
        let root = root.as_ref().to_path_buf();
        create_dirs(&root).map_err(|source| Error::Io {
            op: Op::Open,
            name: String::new(),
            dir: root.display().to_string(),
            what: "creating the directory",
            source,
        })?;
        Ok(LocalBackend {
            root,
            stats: Counters::default(),
        })
    }

    fn io(&self, op: Op, name: &str, what: &'static str) -> impl FnOnce(std::io::Error) -> Error {
        let (name, dir) = (name.to_string(), self.root.display().to_string());
        move |source| {
            if source.kind() == ErrorKind::NotFound && matches!(op, Op::Get | Op::GetRange) {
                Error::NotFound {
                    op,
                    name,
                    store: dir,
                }
            } else {
                Error::Io {
                    op,
                    name,
                    dir,
                    what,
                    source,
                }
            }
        }
    }

    /// Write `bytes` to a fresh temporary file beside `name` and fsync it; returns its path.
    fn write_temp(&self, op: Op, name: &str, bytes: &[u8]) -> Result<(PathBuf, PathBuf)> {
        let path = self.root.join(name);
        let dir = path.parent().unwrap_or(&self.root).to_path_buf();
        create_dirs(&dir).map_err(self.io(op, name, "creating its directory"))?;
        let tmp = dir.join(format!(".tmp-{}", nonce()));
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(self.io(op, name, "creating a temporary file"))?;
        let written = f
            .write_all(bytes)
            .and_then(|_| f.sync_all())
            .map_err(self.io(op, name, "writing a temporary file"));
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
        Ok((tmp, dir))
    }
}

/// `mkdir -p` with mode 0700 for the directories it creates.
fn create_dirs(dir: &Path) -> std::io::Result<()> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

impl ObjectBackend for LocalBackend {
    fn put(&self, name: &str, bytes: &[u8]) -> Result<()> {
        validate_name(name)?;
        let (tmp, dir) = self.write_temp(Op::Put, name, bytes)?;
        let done = fs::rename(&tmp, self.root.join(name))
            .and_then(|_| sync_dir(&dir))
            .map_err(self.io(Op::Put, name, "renaming into place"));
        if done.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        done?;
        self.stats.put(bytes.len());
        Ok(())
    }

    fn get(&self, name: &str) -> Result<Vec<u8>> {
        validate_name(name)?;
        let bytes = fs::read(self.root.join(name)).map_err(self.io(Op::Get, name, "reading"))?;
        self.stats.get(bytes.len());
        Ok(bytes)
    }

    fn get_range(&self, name: &str, start: u64, len: u64) -> Result<Vec<u8>> {
        validate_name(name)?;
        let op = Op::GetRange;
        let mut f = File::open(self.root.join(name)).map_err(self.io(op, name, "opening"))?;
        let size = f
            .metadata()
            .map_err(self.io(op, name, "reading its size"))?
            .len();
        let end = start.saturating_add(len);
        if end > size {
            return Err(Error::RangePastEnd {
                op,
                name: name.to_string(),
                store: self.describe(),
                start,
                end,
                size: SizeText(Some(size)),
            });
        }
        let mut buf = vec![0u8; len as usize];
        f.seek(SeekFrom::Start(start))
            .and_then(|_| f.read_exact(&mut buf))
            .map_err(self.io(op, name, "reading"))?;
        self.stats.get(buf.len());
        Ok(buf)
    }

    fn head(&self, name: &str) -> Result<Option<u64>> {
        validate_name(name)?;
        self.stats.head();
        match fs::metadata(self.root.join(name)) {
            Ok(m) if m.is_file() => Ok(Some(m.len())),
            Ok(_) => Ok(None),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(self.io(Op::Head, name, "reading its metadata")(e)),
        }
    }

    fn list(&self, prefix: &str) -> Result<Vec<(String, u64)>> {
        validate_prefix(prefix)?;
        let mut out = Vec::new();
        let start = if prefix.is_empty() {
            self.root.clone()
        } else {
            self.root.join(prefix)
        };
        let mut stack = vec![(start, prefix.to_string())];
        while let Some((dir, rel)) = stack.pop() {
            let entries = match fs::read_dir(&dir) {
                Ok(e) => e,
                Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::NotADirectory) => {
                    continue
                }
                Err(e) => return Err(self.io(Op::List, prefix, "reading a directory")(e)),
            };
            for entry in entries {
                let entry = entry.map_err(self.io(Op::List, prefix, "reading a directory"))?;
                let Ok(file) = entry.file_name().into_string() else {
                    continue; // not UTF-8: not an object name
                };
                let name = if rel.is_empty() {
                    file
                } else {
                    format!("{rel}/{file}")
                };
                if validate_name(&name).is_err() {
                    continue; // temporaries, foreign files
                }
                let meta = match entry.metadata() {
                    Ok(m) => m,
                    // Deleted between the directory read and this: not listed, as a store
                    // lists what it holds at some instant of the call.
                    Err(e) if e.kind() == ErrorKind::NotFound => continue,
                    Err(e) => return Err(self.io(Op::List, &name, "reading its metadata")(e)),
                };
                if meta.is_dir() {
                    stack.push((entry.path(), name));
                } else if meta.is_file() && under(&name, prefix) {
                    out.push((name, meta.len()));
                }
            }
        }
        out.sort();
        self.stats.list(out.len());
        Ok(out)
    }

    fn delete(&self, name: &str) -> Result<()> {
        validate_name(name)?;
        let path = self.root.join(name);
        self.stats.delete();
        match fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(self.io(Op::Delete, name, "removing")(e)),
        }
        sync_dir(path.parent().unwrap_or(&self.root)).map_err(self.io(
            Op::Delete,
            name,
            "syncing its directory",
        ))
    }

    fn put_if_absent(&self, name: &str, bytes: &[u8]) -> Result<bool> {
        validate_name(name)?;
        let (tmp, dir) = self.write_temp(Op::PutIfAbsent, name, bytes)?;
        // link(2) fails with EEXIST if the name exists: an atomic create-if-absent.
        let linked = fs::hard_link(&tmp, self.root.join(name));
        let _ = fs::remove_file(&tmp);
        match linked {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::AlreadyExists => return Ok(false),
            Err(e) => return Err(self.io(Op::PutIfAbsent, name, "linking into place")(e)),
        }
        sync_dir(&dir).map_err(self.io(Op::PutIfAbsent, name, "syncing its directory"))?;
        self.stats.put(bytes.len());
        Ok(true)
    }

    fn conditional_put_honoured(&self) -> bool {
        true
    }

    fn stats(&self) -> BackendStats {
        self.stats.snapshot()
    }

    fn describe(&self) -> String {
        self.root.display().to_string()
    }
}

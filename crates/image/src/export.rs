//! A volume into a sparse raw file: `condense export NAME FILE` (as raw).
//!
//! Only Data extents are written into a file of the volume's size, so holes stay holes. The
//! file is written next to the target (`FILE.condense-partial-PID`, mode 0600) and renamed into
//! place only when complete and synced: a failed export (no space, an unreadable block) removes
//! its partial file and leaves FILE as it was, whether FILE existed or not. Only a regular file
//! (or nothing) is replaced, and only with `force`.

use crate::error::{Error, Result};
use crate::{Progress, Unit, PIECE};
use condense_api::size::human;
use condense_api::ExtentKind;
use condense_engine::{Pool, VolumeHandle};
use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// What a raw export did; its `Display` is the summary `condense export` prints.
#[derive(Debug, Clone)]
pub struct ExportReport {
    pub volume: String,
    pub path: PathBuf,
    /// The volume's (and the file's) size in bytes.
    pub size: u64,
    /// Bytes of data written (the rest of the file is holes).
    pub data: u64,
}

impl std::fmt::Display for ExportReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exported volume {} to {}: {} logical, {} of data",
            self.volume,
            self.path.display(),
            human(self.size),
            human(self.data)
        )
    }
}

/// Open the export file `path` for writing: created mode 0600 whatever the umask (it holds a
/// volume's data: the owner decides who else gets it); with `replace`, an existing regular file
/// is truncated and made 0600 too before anything is written to it.
pub fn create_private(path: &Path, replace: bool) -> Result<File> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(replace)
        .create_new(!replace)
        .truncate(replace)
        .mode(0o600)
        .open(path)
        .map_err(|source| Error::Create {
            path: path.to_path_buf(),
            source,
        })?;
    let meta = file.metadata().map_err(|source| Error::Examine {
        path: path.to_path_buf(),
        source,
    })?;
    if meta.is_file() && meta.permissions().mode() & 0o077 != 0 {
        file.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(|source| Error::MakePrivate {
                path: path.to_path_buf(),
                source,
            })?;
    }
    Ok(file)
}

/// `condense export NAME FILE` as raw: a sparse file of the volume's size, written next to
/// FILE and renamed into place once complete (module documentation).
pub fn export_raw(
    pool: &Pool,
    name: &str,
    path: &Path,
    force: bool,
    progress: &dyn Progress,
) -> Result<ExportReport> {
    let vol = pool.volume(name).map_err(|source| Error::ExportVolume {
        volume: name.to_string(),
        source,
    })?;
    let size = vol.size().map_err(|source| Error::VolumeExtents {
        volume: name.to_string(),
        source,
    })?;
    match std::fs::symlink_metadata(path) {
        Ok(m) if !m.is_file() => {
            return Err(Error::NotRegularFile {
                path: path.to_path_buf(),
            })
        }
        Ok(_) if !force => {
            return Err(Error::Exists {
                path: path.to_path_buf(),
            })
        }
        _ => {}
    }
    let partial = partial_path(path);
    let out = create_private(&partial, false)?;
    let written = write_raw(&vol, name, size, &out, &partial, progress)
        .and_then(|data| place(&partial, path, force).map(|()| data));
    let data = match written {
        Ok(d) => d,
        Err(e) => {
            drop(out);
            if let Err(r) = std::fs::remove_file(&partial) {
                progress.warn(&format!(
                    "could not remove the partial export {}: {r}",
                    partial.display()
                ));
            }
            return Err(Error::ExportFailed {
                volume: name.to_string(),
                path: path.to_path_buf(),
                source: Box::new(e),
            });
        }
    };
    Ok(ExportReport {
        volume: name.to_string(),
        path: path.to_path_buf(),
        size,
        data,
    })
}

/// Where an export to `path` is written until it is complete: `FILE.condense-partial-PID`,
/// in the same directory (so that the rename is atomic).
fn partial_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".condense-partial-{}", std::process::id()));
    path.with_file_name(name)
}

/// Write the volume's data extents into `out` (sized to `size`) and sync it; returns the
/// bytes of data written.
fn write_raw(
    vol: &VolumeHandle,
    name: &str,
    size: u64,
    out: &File,
    shown: &Path,
    progress: &dyn Progress,
) -> Result<u64> {
    out.set_len(size).map_err(|source| Error::SetLength {
        path: shown.to_path_buf(),
        size,
        source,
    })?;
    let extents = vol
        .extents(0, size)
        .map_err(|source| Error::VolumeExtents {
            volume: name.to_string(),
            source,
        })?;
    let data_total: u64 = extents
        .iter()
        .filter(|e| e.kind == ExtentKind::Data)
        .map(|e| e.len)
        .sum();
    progress.start(&format!("exporting {name}"), data_total, Unit::Bytes);
    let mut buf = Vec::new();
    let mut done = 0u64;
    for e in extents.iter().filter(|e| e.kind == ExtentKind::Data) {
        let mut pos = e.offset;
        while pos < e.offset + e.len {
            let n = PIECE.min(e.offset + e.len - pos);
            buf.resize(n as usize, 0);
            vol.read_at(pos, &mut buf)
                .map_err(|source| Error::ReadVolume {
                    volume: name.to_string(),
                    offset: pos,
                    source,
                })?;
            out.write_all_at(&buf, pos)
                .map_err(|source| Error::WriteFile {
                    path: shown.to_path_buf(),
                    offset: pos,
                    source,
                })?;
            pos += n;
            done += n;
            progress.set(done);
        }
    }
    out.sync_all().map_err(|source| Error::SyncFile {
        path: shown.to_path_buf(),
        source,
    })?;
    progress.finish();
    Ok(data_total)
}

/// Rename the complete export `partial` to `path`: replacing a file there only if `replace`,
/// and never one that appeared since the start (RENAME_NOREPLACE); then sync the directory.
fn place(partial: &Path, path: &Path, replace: bool) -> Result<()> {
    let rename_failed = |source| Error::Rename {
        from: partial.to_path_buf(),
        to: path.to_path_buf(),
        source,
    };
    if replace {
        std::fs::rename(partial, path).map_err(rename_failed)?;
    } else {
        let c_path = |p: &Path| {
            std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(|e| {
                rename_failed(std::io::Error::new(std::io::ErrorKind::InvalidInput, e))
            })
        };
        let (from, to) = (c_path(partial)?, c_path(path)?);
        // SAFETY: two NUL-terminated paths that live across the call.
        let rc = unsafe {
            libc::renameat2(
                libc::AT_FDCWD,
                from.as_ptr(),
                libc::AT_FDCWD,
                to.as_ptr(),
                libc::RENAME_NOREPLACE,
            )
        };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::EEXIST) => {
                    return Err(Error::AppearedDuringExport {
                        path: path.to_path_buf(),
                    })
                }
                // A file system without RENAME_NOREPLACE (some network and FUSE ones).
                Some(libc::EINVAL) if !path.exists() => {
                    std::fs::rename(partial, path).map_err(rename_failed)?
                }
                _ => return Err(rename_failed(err)),
            }
        }
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|source| Error::SyncDirectory {
            path: dir.to_path_buf(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_exports_sit_beside_the_target() {
        let pid = std::process::id();
        assert_eq!(
            partial_path(Path::new("/srv/out.raw")),
            PathBuf::from(format!("/srv/out.raw.condense-partial-{pid}"))
        );
        assert_eq!(
            partial_path(Path::new("out.raw")),
            PathBuf::from(format!("out.raw.condense-partial-{pid}"))
        );
    }

    #[test]
    fn place_never_replaces_without_force() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let (partial, target) = (dir.path().join("p"), dir.path().join("t"));
        std::fs::write(&partial, b"new")?;
        std::fs::write(&target, b"old")?;
        assert!(matches!(
            place(&partial, &target, false),
            Err(Error::AppearedDuringExport { .. })
        ));
        assert_eq!(std::fs::read(&target)?, b"old");
        place(&partial, &target, true)?;
        assert_eq!(std::fs::read(&target)?, b"new");
        assert!(!partial.exists());
        Ok(())
    }
}

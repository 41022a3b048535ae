//! The engine's error type.
//!
//! Policy: every error says what failed and where (volume, block, file, offset). Bad bytes from
//! disk are errors ([`Error::Corrupt`], [`Error::Checksum`]), never panics. After an I/O error
//! that may have left the in-memory state ahead of the disk, the pool refuses further writes
//! ([`Error::Poisoned`]) until it is reopened, which recovers from the journal.

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("volume {0:?} not found")]
    NotFound(String),
    #[error("volume {0:?} already exists")]
    AlreadyExists(String),
    #[error("{0}")]
    Invalid(String),
    #[error("{op} of {len} bytes at offset {offset} is past the end of volume {volume:?} ({size} bytes)")]
    OutOfRange {
        op: &'static str,
        volume: String,
        offset: u64,
        len: u64,
        size: u64,
    },
    #[error("no space left on the pool's disk while {0}; free space (delete volumes, run `condense gc`) and retry")]
    NoSpace(String),
    #[error("checksum mismatch in {what}: expected {expected:08x}, found {found:08x}")]
    Checksum {
        what: String,
        expected: u32,
        found: u32,
    },
    #[error("damaged {what}: {detail}")]
    Corrupt { what: String, detail: String },
    #[error("volume {volume:?} block {block} was lost: `condense repair` found its data damaged beyond recovery (`condense repair --history` lists it). It reads as an I/O error until it is written again: restore it from a backup, or copy the rest with `condense export --lost-as-zeros`")]
    Lost { volume: String, block: u64 },
    #[error("authentication failed for {what}: {detail}")]
    Auth { what: String, detail: String },
    #[error("pool {0} is encrypted: give its key with --key-file FILE or --passphrase-file FILE (or set CONDENSE_KEY_FILE / CONDENSE_PASSPHRASE_FILE)")]
    KeyRequired(String),
    #[error("{0}")]
    WrongKey(String),
    #[error("pool {0} is not encrypted, yet a key was given (--key-file, --passphrase-file, $CONDENSE_KEY_FILE, $CONDENSE_PASSPHRASE_FILE or a config file): nothing was written in the clear. If this pool should be encrypted, its directory may have been replaced: find out by whom before writing to it. If it is meant to be plaintext, drop the key option")]
    NotEncrypted(String),
    #[error("{0} is not a Condense pool (no superblock); create one with `condense init`")]
    NotAPool(PathBuf),
    #[error("the pool's writeback cache directory {0} is missing or unreadable: it holds writes not yet destaged to the pool's own directory. Make it available at that path again (mount the cache device), or, if the device is lost, run `condense cache detach --force` to open the pool without it (the writes it held are lost; `condense repair` then reports the blocks affected)")]
    WritebackCacheMissing(String),
    #[error("pool {0} is in use by another process (a `condense serve` or `condense mount`?); stop it first")]
    Locked(PathBuf),
    #[error("the pool is open read-only")]
    ReadOnly,
    #[error("{0:?} is a snapshot, which is read-only (clone it to get a writable volume: `condense volume clone`)")]
    SnapshotReadOnly(String),
    #[error("volume {volume:?} was moved to host {host}: it is written there now (this host only reads it until that host adopted it)")]
    VolumeMoved { volume: String, host: String },
    #[error("volume {volume:?}: writes are refused here: {why}")]
    WritesRefused { volume: String, why: String },
    #[error("{0}")]
    Busy(String),
    #[error("volume {volume:?} is held by host {host}, which shares this pool{detail}: pick another name, or move it here (`condense volume move {volume} --to HOST` on that host)")]
    HeldByHost {
        volume: String,
        host: String,
        /// How it was decided, if not by a claim already there.
        detail: String,
    },
    #[error("unsupported format version {found} of {what}: this build of condense reads version {supported} only; open the pool with the condense release that wrote it, `condense export` its volumes, and import them into a new pool")]
    Version {
        what: &'static str,
        found: u32,
        supported: u32,
    },
    #[error(
        "an earlier I/O error left the pool in an unknown state ({0}); reopen the pool to recover"
    )]
    Poisoned(String),
    #[error("I/O error on {what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    pub fn io(what: impl Into<String>, source: std::io::Error) -> Error {
        if source.raw_os_error() == Some(libc::ENOSPC) {
            return Error::NoSpace(what.into());
        }
        Error::Io {
            what: what.into(),
            source,
        }
    }

    pub fn corrupt(what: impl Into<String>, detail: impl Into<String>) -> Error {
        Error::Corrupt {
            what: what.into(),
            detail: detail.into(),
        }
    }

    /// True for errors caused by the disk or by damaged bytes (as opposed to bad arguments).
    pub fn is_damage(&self) -> bool {
        matches!(
            self,
            Error::Checksum { .. } | Error::Corrupt { .. } | Error::Auth { .. }
        )
    }
}

impl From<Error> for condense_api::VolumeError {
    fn from(e: Error) -> Self {
        use condense_api::VolumeError as V;
        match e {
            Error::NotFound(n) => V::NotFound(n),
            Error::AlreadyExists(n) => V::AlreadyExists(n),
            Error::Invalid(m) => V::Invalid(m),
            Error::OutOfRange {
                op,
                volume,
                offset,
                len,
                size,
            } => V::OutOfRange {
                op,
                volume,
                offset,
                len,
                size,
            },
            Error::NoSpace(m) => V::NoSpace(m),
            Error::ReadOnly
            | Error::SnapshotReadOnly(_)
            | Error::VolumeMoved { .. }
            | Error::WritesRefused { .. } => V::ReadOnly,
            Error::Busy(m) => V::Busy(m),
            e @ Error::HeldByHost { .. } => V::Busy(e.to_string()),
            e @ (Error::Checksum { .. }
            | Error::Corrupt { .. }
            | Error::Auth { .. }
            | Error::Lost { .. }) => V::Corrupt(e.to_string()),
            e => V::Io(e.to_string()),
        }
    }
}

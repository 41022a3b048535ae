//! The library behind `condense import` and `condense export`: disk images into and out of a
//! pool's volumes.
//!
//! - [`import`]: a raw image file (only its data extents, SEEK_DATA/SEEK_HOLE) or a raw stream
//!   on standard input (all-zero blocks skipped) into a new volume, read on a thread that
//!   stays ahead of the engine, in pieces of [`PIECE`] bytes.
//! - [`export`]: a volume into a sparse raw file, written beside the target and renamed into
//!   place only once complete and synced.
//! - [`convert`]: the formats qemu-img knows (qcow2, vmdk, vdi, vhdx, vpc), through `qemu-img
//!   convert` to or from an in-process NBD export on a private Unix socket.
//!
//! Invariants, kept by each direction:
//! - holes stay holes, both ways;
//! - an import that fails deletes its volume again ("nothing was kept"); one that is killed
//!   leaves its volume marked as an import in progress (`engine::importing`) until deleted;
//! - an export that fails leaves its target file as it was, whether it existed or not; every
//!   file an export creates is mode 0600 whatever the umask (it holds a volume's data).
//!
//! Prints nothing: progress and warnings go through [`Progress`], which the caller implements
//! (the CLI with progress bars), results come back as reports whose `Display` is the summary
//! line `condense` prints, and errors are [`Error`]s that name what failed, where, and what to
//! do.

#![deny(clippy::unwrap_used)]

pub mod convert;
pub mod error;
pub mod export;
pub mod import;
mod source;

pub use error::{Error, Result};
pub use export::{export_raw, ExportReport};
pub use import::{import_raw, import_stdin, ImportReport};

use std::path::Path;

/// Bytes read or written at a time: a whole number of blocks of every block size.
pub const PIECE: u64 = 8 << 20;

/// What a step's progress counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// Bytes of data.
    Bytes,
    /// Hundredths of a percent (qemu-img reports a percentage only): the total is 10,000.
    HundredthsOfPercent,
}

/// How import and export report what they do while they run. The CLI draws a progress bar per
/// step and prints warnings on standard error; [`Silent`] ignores everything.
pub trait Progress {
    /// A step starts: `what` ("importing vm") of `total` units.
    fn start(&self, what: &str, total: u64, unit: Unit);
    /// `done` units of the current step are done (never more than its total).
    fn set(&self, done: u64);
    /// The current step ended, done or failed: remove what `start` showed.
    fn finish(&self);
    /// Something the user should know that is not the error itself: a cleanup that failed, a
    /// wait that needs explaining.
    fn warn(&self, message: &str);
}

/// A [`Progress`] that shows nothing (tests, callers without a terminal).
pub struct Silent;

impl Progress for Silent {
    fn start(&self, _what: &str, _total: u64, _unit: Unit) {}
    fn set(&self, _done: u64) {}
    fn finish(&self) {}
    fn warn(&self, _message: &str) {}
}

/// The image format an output file name asks for: its extension if qemu-img writes it
/// (qcow2, vmdk, vdi, vhdx), else raw.
pub fn format_from_extension(path: &Path) -> String {
    match path
        .extension()
        .and_then(|e| e.to_str())
        .map(|e| e.to_ascii_lowercase())
        .as_deref()
    {
        Some(e @ ("qcow2" | "vmdk" | "vdi" | "vhdx")) => e.to_string(),
        _ => "raw".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_formats_come_from_the_extension() {
        assert_eq!(format_from_extension(Path::new("a/vm.QCOW2")), "qcow2");
        assert_eq!(format_from_extension(Path::new("vm.vhdx")), "vhdx");
        assert_eq!(format_from_extension(Path::new("vm.img")), "raw");
        assert_eq!(format_from_extension(Path::new("vm")), "raw");
    }
}

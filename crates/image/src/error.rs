//! This crate's errors. Each names what failed and where (the image, the volume, the file, the
//! offset) and, where there is something to do, what; the cause (an I/O error, the engine's,
//! the NBD server's) is its `source()`, so anyhow's `{:#}` prints `what: cause`. An import or
//! export that fails as a whole wraps the step that failed ([`Error::ImportFailed`],
//! [`Error::ExportFailed`]), which says what was kept.

use condense_api::size::human;
use condense_api::VolumeError;
use condense_nbd::NbdError;
use std::io;
use std::path::PathBuf;

/// A cause of either kind the volumes report: the engine's own, or the Volume API's.
pub type Cause = Box<dyn std::error::Error + Send + Sync + 'static>;

/// An error of an import or an export.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    // The image file an import reads.
    #[error("cannot examine image {}", .path.display())]
    ExamineImage { path: PathBuf, source: io::Error },
    #[error("image {} is empty", .path.display())]
    EmptyImage { path: PathBuf },
    #[error(
        "image {} is {size} bytes, not a multiple of the pool's block size ({block_size}); pad it with `truncate -s %{block_size} {}` and retry",
        .path.display(),
        .path.display()
    )]
    ImageNotWholeBlocks {
        path: PathBuf,
        size: u64,
        block_size: u64,
    },
    #[error("reading the image at offset {offset}")]
    ReadImage { offset: u64, source: io::Error },

    // Standard input (`condense import -`).
    #[error("--size must be more than 0")]
    ZeroSize,
    #[error(
        "--size {} ({size} bytes) is not a multiple of the pool's block size ({block_size}); use {} bytes",
        human(*.size),
        .size.div_ceil(*.block_size) * .block_size
    )]
    SizeNotWholeBlocks { size: u64, block_size: u64 },
    #[error("reading standard input at byte {offset}")]
    ReadInput { offset: u64, source: io::Error },
    #[error("reading standard input")]
    ReadInputPastSize { source: io::Error },
    #[error(
        "standard input starts like a {format} image, not raw; import it from a file (`condense import IMAGE`), or, if it is a raw disk whose first sector only looks like that (a guest can write one), pass --format raw"
    )]
    InputIsImage { format: &'static str },
    #[error("standard input was empty")]
    EmptyInput,
    /// Standard input held more than --size: `read` bytes so far. [`crate::import_stdin`]
    /// turns it into [`Error::InputLongerThanSize`] once it counted the rest.
    #[error("standard input holds more than --size")]
    InputTooLong { read: u64 },
    #[error(
        "import of standard input failed; nothing was kept: it holds {} ({total} bytes), {} bytes more than --size {} ({size} bytes); retry with --size {fits}",
        human(*.total),
        .total - .size,
        human(*.size)
    )]
    InputLongerThanSize { total: u64, size: u64, fits: u64 },
    #[error(
        "import of standard input failed; nothing was kept: it holds more than --size {} ({size} bytes), at least {read} bytes (reading the rest failed: {error})",
        human(*.size)
    )]
    InputLongerUncounted {
        size: u64,
        read: u64,
        error: io::Error,
    },

    // The pool and its volumes.
    #[error("cannot read the pool's statistics")]
    Stats { source: condense_engine::Error },
    #[error("cannot create volume {volume:?}")]
    CreateVolume { volume: String, source: Cause },
    #[error("cannot open volume {volume:?}")]
    OpenVolume { volume: String, source: Cause },
    #[error("cannot record whether volume {volume:?} is being imported")]
    MarkImporting {
        volume: String,
        source: condense_engine::Error,
    },
    #[error("writing volume {volume:?} at offset {offset}")]
    WriteVolume {
        volume: String,
        offset: u64,
        source: condense_engine::Error,
    },
    #[error("reading volume {volume:?} at offset {offset}")]
    ReadVolume {
        volume: String,
        offset: u64,
        source: condense_engine::Error,
    },
    #[error("cannot read the size and extents of volume {volume:?}")]
    VolumeExtents {
        volume: String,
        source: condense_engine::Error,
    },
    #[error("the image reader thread failed")]
    ReaderPanicked,
    #[error("making the import durable")]
    MakeDurable { source: condense_engine::Error },
    #[error("import of {what} failed; nothing was kept")]
    ImportFailed { what: String, source: Box<Error> },

    // The file an export writes.
    #[error("cannot export volume {volume:?}")]
    ExportVolume {
        volume: String,
        source: condense_engine::Error,
    },
    #[error(
        "{} exists and is not a regular file; export writes regular files only (to write a device, serve the volume and copy it with nbdcopy)",
        .path.display()
    )]
    NotRegularFile { path: PathBuf },
    #[error("{} exists; pass --force to overwrite it", .path.display())]
    Exists { path: PathBuf },
    #[error("{} appeared during the export; pass --force to overwrite it", .path.display())]
    AppearedDuringExport { path: PathBuf },
    #[error("cannot create {}", .path.display())]
    Create { path: PathBuf, source: io::Error },
    #[error("cannot examine {}", .path.display())]
    Examine { path: PathBuf, source: io::Error },
    #[error("cannot make {} owner-only (chmod 600)", .path.display())]
    MakePrivate { path: PathBuf, source: io::Error },
    #[error("cannot remove {}", .path.display())]
    Remove { path: PathBuf, source: io::Error },
    #[error("cannot size {} to {size} bytes", .path.display())]
    SetLength {
        path: PathBuf,
        size: u64,
        source: io::Error,
    },
    #[error("writing {} at offset {offset}", .path.display())]
    WriteFile {
        path: PathBuf,
        offset: u64,
        source: io::Error,
    },
    #[error("syncing {}", .path.display())]
    SyncFile { path: PathBuf, source: io::Error },
    #[error("cannot rename {} to {}", .from.display(), .to.display())]
    Rename {
        from: PathBuf,
        to: PathBuf,
        source: io::Error,
    },
    #[error("syncing directory {}", .path.display())]
    SyncDirectory { path: PathBuf, source: io::Error },
    #[error("export of volume {volume:?} failed; {} was left as it was", .path.display())]
    ExportFailed {
        volume: String,
        path: PathBuf,
        source: Box<Error>,
    },

    // qemu-img and the NBD export it reads or writes.
    #[error("{volume:?} cannot be a volume name for import (empty, or starts with '.')")]
    NotImportableName { volume: String },
    #[error("volume {volume:?} cannot be exported (empty name, or internal)")]
    NotExportableName { volume: String },
    #[error("{} already exists; remove it first", .path.display())]
    OutputExists { path: PathBuf },
    #[error("cannot read pool usage")]
    Usage { source: VolumeError },
    #[error("cannot list the pool's volumes")]
    ListVolumes { source: VolumeError },
    #[error("cannot flush the pool")]
    FlushPool { source: VolumeError },
    #[error("cannot create a socket directory {}", .path.display())]
    SocketDirectory { path: PathBuf, source: io::Error },
    #[error("cannot serve on {}", .path.display())]
    Serve { path: PathBuf, source: NbdError },
    #[error("cannot start the NBD server")]
    StartServer { source: NbdError },
    #[error("stopping the {direction} server")]
    StopServer {
        /// "import" or "export".
        direction: &'static str,
        source: NbdError,
    },
    #[error("cannot run qemu-img (install qemu-utils)")]
    RunQemuImg { source: io::Error },
    #[error("waiting for qemu-img")]
    WaitQemuImg { source: io::Error },
    #[error("qemu-img convert failed ({status}): {message}")]
    QemuImgFailed {
        status: std::process::ExitStatus,
        message: String,
    },
    #[error(
        "image {} changed while it was imported (its size or modification time moved), so what was checked is not what was read; import an image nobody is writing to",
        .path.display()
    )]
    ImageChanged { path: PathBuf },
    #[error("import of {} failed", .path.display())]
    ConvertFailed { path: PathBuf, source: Box<Error> },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

//! `condense mount`'s options; mounting is `condense_service::mount` (docs/FUSE.md).

use condense_service::mount::MountOptions;
use std::path::PathBuf;

#[derive(clap::Args, Debug, Clone)]
pub struct MountArgs {
    /// An existing empty directory to mount on (or `mountpoint = "DIR"` in the --config file).
    pub mountpoint: PathBuf,
    /// Let other users use the mount (for a non-root user this needs `user_allow_other` in
    /// /etc/fuse.conf). The kernel still checks file modes, and with the default --umask 077
    /// the mount belongs to you alone: give --umask too (e.g. 022) to open it to others.
    #[arg(long)]
    pub allow_other: bool,
    /// Mode bits (octal, as in sshfs's or vfat's `-o umask=`) taken away from the mount's top
    /// directories (0777), the volume files in volumes/ (0666) and the snapshot files (0444).
    /// Default 077: everything owned by the mounting user and open to nobody else, even with
    /// --allow-other. 022: everyone may read volumes (and write none); 007: your group may
    /// read and write them. Files you create under files/ keep the mode they are given.
    #[arg(long, value_name = "OCTAL", default_value = "077", value_parser = parse_umask)]
    pub umask: u32,
    /// Refuse every change (EROFS).
    #[arg(long)]
    pub read_only: bool,
    /// Let the kernel cache buffered writes to files/ (FUSE writeback cache). A write(2) then
    /// returns once the data is in the page cache, and the kernel passes it on later, in
    /// requests of up to 1 MiB and several at once. The mount then raises the kernel's limit
    /// on its dirty pages from 1 % to 20 % of the system's (root only), without which the
    /// cache throttled writers and made them slower; with it, buffered random 4 KiB writes
    /// to files/ ran about as fast as to a plain file on the development VM (docs/FUSE.md).
    /// Data written to files/ then reaches the pool only at writeback (within ~30 s at most),
    /// fsync, close or unmount: a `condense snapshot create` taken meanwhile does not contain
    /// it. Durability
    /// is the same either way (only fsync promises it). volumes/ files bypass the page cache
    /// with this option (direct I/O: a volume keeps its size, and a write past its end fails
    /// at once), so buffered reads of them are not cached, and a `condense volume resize`
    /// shows in volumes/ only once the kernel forgets the file. O_DIRECT I/O is not affected.
    /// Off by default (docs/FUSE.md).
    #[arg(long)]
    pub writeback_cache: bool,
    #[command(flatten)]
    pub cache: crate::MetadataCacheArg,
    #[command(flatten)]
    pub tier: crate::cache::CacheTierArg,
    #[command(flatten)]
    pub scrub: crate::scrub::ScrubArg,
    #[command(flatten)]
    pub config: condense_service::config::ConfigArg,
    /// Serve Prometheus metrics at http://HOST:PORT/metrics (reads and writes with their
    /// bytes and latency, savings, dead bytes, GC, journal and checkpoint timings;
    /// docs/METRICS.md). Off by default; use a loopback address unless the network in between
    /// is trusted (there is no authentication).
    #[arg(long, value_name = "HOST:PORT")]
    pub metrics_listen: Option<String>,
}

/// `--umask`: three octal digits at most.
fn parse_umask(s: &str) -> Result<u32, String> {
    match u32::from_str_radix(s, 8) {
        Ok(m) if m <= 0o777 => Ok(m),
        _ => Err(format!(
            "{s:?} is not a umask: give octal digits, 000 to 777 (e.g. 077)"
        )),
    }
}

impl MountArgs {
    /// The options as the service takes them.
    pub fn options(&self) -> MountOptions {
        MountOptions {
            mountpoint: self.mountpoint.clone(),
            allow_other: self.allow_other,
            umask: self.umask,
            read_only: self.read_only,
            writeback_cache: self.writeback_cache,
            metrics_listen: self.metrics_listen.clone(),
        }
    }
}

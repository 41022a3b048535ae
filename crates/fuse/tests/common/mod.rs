//! Shared set-up of the mount tests: a MemCatalog-backed mount on a temporary directory.
#![allow(dead_code)]

use condense_api::mem::MemCatalog;
use condense_api::Catalog;
use condense_fuse::{MountOptions, Mounted};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

pub const BLOCK: u64 = 4096;

/// Whether this machine can mount FUSE file systems. When it cannot, the test is skipped with
/// a printed reason, unless CI=true, where the test fails instead.
pub fn fuse_usable() -> bool {
    let reason = if !Path::new("/dev/fuse").exists() {
        Some("/dev/fuse is missing")
    } else if !nix::unistd::geteuid().is_root() && which("fusermount3").is_none() {
        Some("not root and no fusermount3 (Debian package fuse3)")
    } else {
        None
    };
    match reason {
        None => true,
        Some(r) if std::env::var("CI").as_deref() == Ok("true") => {
            panic!("FUSE mount tests cannot run on this CI machine: {r}")
        }
        Some(r) => {
            eprintln!("SKIPPED: {r}");
            false
        }
    }
}

fn which(bin: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(bin))
        .find(|p| p.exists())
}

/// A mount of a catalog on a temporary directory; unmounted on drop.
pub struct TestMount {
    pub catalog: Arc<MemCatalog>,
    pub mounted: Option<Mounted>,
    pub dir: tempfile::TempDir,
    _watchdog: Watchdog,
}

/// A test that hangs on its own mount would hang CI for good (its threads wait for replies
/// that only it can send). After this long the watchdog aborts the FUSE connection, which
/// fails every pending request, and ends the process.
const HANG_SECS: u64 = 300;

struct Watchdog {
    done: Option<std::sync::mpsc::Sender<()>>,
}

impl Watchdog {
    fn new(mountpoint: &Path) -> Watchdog {
        use std::os::unix::fs::MetadataExt;
        let dev = std::fs::metadata(mountpoint).map(|m| m.dev()).unwrap_or(0);
        let minor = nix::sys::stat::minor(dev);
        let shown = mountpoint.display().to_string();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        std::thread::spawn(move || {
            if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                rx.recv_timeout(std::time::Duration::from_secs(HANG_SECS))
            {
                eprintln!("mount {shown} hung for {HANG_SECS} s: aborting its FUSE connection");
                let conns = Path::new("/sys/fs/fuse/connections");
                if std::fs::read_dir(conns)
                    .map(|mut d| d.next().is_none())
                    .unwrap_or(true)
                {
                    let _ = Command::new("mount")
                        .args(["-t", "fusectl", "none"])
                        .arg(conns)
                        .status();
                }
                let _ = std::fs::write(conns.join(minor.to_string()).join("abort"), "1");
                std::process::exit(101);
            }
        });
        Watchdog { done: Some(tx) }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        if let Some(tx) = self.done.take() {
            let _ = tx.send(());
        }
    }
}

impl TestMount {
    pub fn new() -> TestMount {
        Self::with_catalog(
            Arc::new(MemCatalog::new(BLOCK as u32)),
            MountOptions::default(),
        )
    }

    pub fn with_catalog(catalog: Arc<MemCatalog>, opts: MountOptions) -> TestMount {
        let dir = tempfile::tempdir().expect("temp dir");
        let dyn_cat: Arc<dyn Catalog> = catalog.clone();
        let mounted = condense_fuse::spawn(dyn_cat, dir.path(), opts).expect("mount");
        let watchdog = Watchdog::new(dir.path());
        TestMount {
            catalog,
            mounted: Some(mounted),
            dir,
            _watchdog: watchdog,
        }
    }

    pub fn root(&self) -> &Path {
        self.dir.path()
    }
    pub fn files(&self) -> PathBuf {
        self.dir.path().join("files")
    }
    pub fn volume(&self, name: &str) -> PathBuf {
        self.dir.path().join("volumes").join(name)
    }

    /// Unmount cleanly (fails the test if busy) and give the catalog back.
    pub fn unmount(mut self) -> Arc<MemCatalog> {
        if let Some(m) = self.mounted.take() {
            m.unmount().expect("unmount");
        }
        self.catalog.clone()
    }
}

/// Deterministic pseudo-random bytes (xorshift), so failures replay.
pub fn pseudo_random(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// A small "VM image": runs of random data, zeros, and blocks shared with other images.
pub fn image(seed: u64, blocks: usize) -> Vec<u8> {
    let shared = pseudo_random(7, 64 * BLOCK as usize);
    let mut out = Vec::with_capacity(blocks * BLOCK as usize);
    for b in 0..blocks {
        match (b + seed as usize) % 5 {
            0 | 1 => {
                out.extend_from_slice(&pseudo_random(seed * 1_000_003 + b as u64, BLOCK as usize))
            }
            2 => out.extend(std::iter::repeat_n(0u8, BLOCK as usize)),
            _ => {
                let at = (b % 64) * BLOCK as usize;
                out.extend_from_slice(&shared[at..at + BLOCK as usize]);
            }
        }
    }
    // An odd tail, so lengths are not block multiples.
    out.extend_from_slice(&pseudo_random(seed, 1234));
    out
}

pub fn errno(e: &std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(0)
}

//! Helpers of the tests of pools several hosts share (hosts.rs, handover.rs): a directory
//! used as the object store, volumes of tagged blocks written and checked, segment bytes.
//! Included by each with `#[path = "shared_pool/mod.rs"] mod shared_pool;`.

use condense_engine::format::hosts::VolumeClaim;
use condense_engine::remote::RemoteConf;
use condense_engine::{OpenOptions, Pool};
use std::path::Path;
use std::sync::Arc;

pub const BS: usize = 4096;
pub const CACHE: u64 = 1 << 30;

/// Distinct, compressible content for each tag.
pub fn block(tag: u64) -> Vec<u8> {
    let mut b: Vec<u8> = (0..BS)
        .map(|i| ((i / 16) as u64).wrapping_mul(tag | 1) as u8)
        .collect();
    b[..8].copy_from_slice(&tag.to_le_bytes());
    b
}

pub fn conf(store: &Path) -> RemoteConf {
    RemoteConf {
        url: format!("file://{}", store.display()),
        endpoint: None,
        region: None,
        credentials: None,
        durability_to_store: None,
        read_only: false,
    }
}

pub fn open(path: &Path) -> Arc<Pool> {
    Pool::open_path(
        path,
        OpenOptions {
            destage_in_background: false,
            ..Default::default()
        },
    )
    .expect("open")
}

pub fn write(pool: &Pool, vol: &str, first_tag: u64, blocks: u64) {
    pool.create_volume(vol, blocks * BS as u64).expect("create");
    overwrite(pool, vol, first_tag, blocks);
}

/// Blocks 0..`blocks` of the existing volume `vol` written again, with tags from `first_tag`.
pub fn overwrite(pool: &Pool, vol: &str, first_tag: u64, blocks: u64) {
    let h = pool.volume(vol).expect("volume");
    let data: Vec<u8> = (0..blocks).flat_map(|b| block(first_tag + b)).collect();
    h.write_at(0, &data, false).expect("write");
    pool.flush().expect("flush");
}

pub fn check(pool: &Pool, vol: &str, first_tag: u64, blocks: u64) {
    let h = pool.volume(vol).expect("volume");
    let mut buf = vec![0u8; blocks as usize * BS];
    h.read_at(0, &mut buf).expect("read");
    for b in 0..blocks as usize {
        assert!(
            buf[b * BS..(b + 1) * BS] == block(first_tag + b as u64)[..],
            "volume {vol} block {b} differs"
        );
    }
}

/// Bytes of segment objects under `dir` (one host's tree: the first host's excludes `hosts/`).
pub fn segment_bytes(dir: &Path, skip_hosts: bool) -> u64 {
    fn walk(dir: &Path, skip_hosts: bool, out: &mut u64) {
        for e in std::fs::read_dir(dir).expect("read store").flatten() {
            let p = e.path();
            if p.is_dir() {
                if !(skip_hosts && (p.ends_with("hosts") || p.ends_with("members"))) {
                    walk(&p, false, out);
                }
            } else if p
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("seg-"))
            {
                *out += e.metadata().map_or(0, |m| m.len());
            }
        }
    }
    let mut out = 0;
    walk(dir, skip_hosts, &mut out);
    out
}

/// The claims of volume `name` in the store, as (turn, slot).
pub fn claims_of(store: &Path, name: &str) -> Vec<(u32, u8)> {
    let prefix = VolumeClaim::prefix(Some(name));
    let dir = store.join(prefix.trim_end_matches('/'));
    let mut out: Vec<(u32, u8)> = std::fs::read_dir(&dir)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| {
                    let obj = format!("{prefix}{}", e.file_name().to_string_lossy());
                    VolumeClaim::parse_object(&obj).map(|c| (c.turn, c.slot))
                })
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

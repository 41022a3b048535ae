//! The FUSE mount over the real storage engine: images copied into `files/` deduplicate, a
//! volume file takes writes, and everything is there after unmount, pool close and reopen.

mod common;

use common::{image, pseudo_random, BLOCK};
use condense_api::Catalog;
use condense_engine::pool::{InitOptions, OpenOptions, Pool};
use condense_fuse::MountOptions;
use std::fs;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

const MIB: u64 = 1 << 20;

fn open(dir: &std::path::Path) -> Arc<Pool> {
    Pool::open_path(dir, OpenOptions::default()).expect("open pool")
}

#[test]
fn engine_backed_round_trip_dedup_and_reopen() {
    if !common::fuse_usable() {
        return;
    }
    let pool_dir = tempfile::tempdir().expect("temp dir");
    Pool::init_path(pool_dir.path(), &InitOptions::default()).expect("init pool");
    let pool = open(pool_dir.path());
    pool.create_volume("disk", 16 * MIB).expect("create volume");

    let base = image(1, 1500);
    // Ten "VM images" that share most of their blocks.
    let images: Vec<Vec<u8>> = (0..10u64)
        .map(|i| {
            let mut img = base.clone();
            let at = (i as usize * 37 % 1400) * BLOCK as usize;
            img[at..at + 4096].copy_from_slice(&pseudo_random(100 + i, 4096));
            img
        })
        .collect();
    let vol_data = pseudo_random(77, 3 * MIB as usize + 5);
    {
        let mnt = tempfile::tempdir().expect("mount dir");
        let cat: Arc<dyn Catalog> = pool.clone();
        let m = condense_fuse::spawn(cat, mnt.path(), MountOptions::default()).expect("mount");
        let files = mnt.path().join("files/vms");
        fs::create_dir(&files).expect("mkdir");
        for (i, img) in images.iter().enumerate() {
            fs::write(files.join(format!("vm{i}.img")), img).expect("copy image in");
        }
        for (i, img) in images.iter().enumerate() {
            let back = fs::read(files.join(format!("vm{i}.img"))).expect("read back");
            assert!(back == *img, "vm{i}.img differs");
        }
        let f = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(mnt.path().join("volumes/disk"))
            .expect("open volume file");
        f.write_all_at(&vol_data, MIB).expect("write volume");
        f.sync_all().expect("fsync");
        drop(f);
        m.unmount().expect("unmount");
    }
    // Shared blocks are stored once: far less than ten copies.
    let stats = pool.stats().expect("stats");
    let logical: u64 = images.iter().map(|i| i.len() as u64).sum();
    assert!(
        stats.stored_bytes < logical / 5,
        "ten near-identical images ({logical} bytes) stored in {} bytes",
        stats.stored_bytes
    );
    pool.close().expect("close pool");
    drop(pool);

    let pool = open(pool_dir.path());
    let mnt = tempfile::tempdir().expect("mount dir");
    let cat: Arc<dyn Catalog> = pool.clone();
    let m = condense_fuse::spawn(cat, mnt.path(), MountOptions::default()).expect("remount");
    for (i, img) in images.iter().enumerate() {
        let back = fs::read(mnt.path().join(format!("files/vms/vm{i}.img"))).expect("read");
        assert!(back == *img, "vm{i}.img differs after reopen");
    }
    let f = fs::File::open(mnt.path().join("volumes/disk")).expect("open");
    let mut back = vec![0u8; vol_data.len()];
    f.read_exact_at(&mut back, MIB).expect("read volume");
    assert!(back == vol_data);
    drop(f);
    fs::remove_dir_all(mnt.path().join("files/vms")).expect("rm -r");
    m.unmount().expect("unmount");
    let left: Vec<String> = pool
        .list()
        .expect("list")
        .into_iter()
        .map(|v| v.name)
        .collect();
    assert_eq!(
        left,
        ["disk"],
        "removing the files deleted their content volumes"
    );
    pool.close().expect("close");
}

#[test]
fn engine_snapshots_show_read_only_under_snapshots() {
    if !common::fuse_usable() {
        return;
    }
    let pool_dir = tempfile::tempdir().expect("temp dir");
    Pool::init_path(pool_dir.path(), &InitOptions::default()).expect("init pool");
    let pool = open(pool_dir.path());
    pool.create_volume("vm", 4 * MIB).expect("create volume");
    let old = pseudo_random(5, 4 * MIB as usize);
    pool.volume("vm")
        .and_then(|h| h.write_at(0, &old, false))
        .expect("write");
    let mnt = tempfile::tempdir().expect("mount dir");
    let cat: Arc<dyn Catalog> = pool.clone();
    let m = condense_fuse::spawn(cat, mnt.path(), MountOptions::default()).expect("mount");
    // Taken while mounted: it shows up, and keeps the old content after the volume changes.
    pool.create_snapshot("vm", "before").expect("snapshot");
    let new = pseudo_random(6, MIB as usize);
    let vol = fs::OpenOptions::new()
        .write(true)
        .open(mnt.path().join("volumes/vm"))
        .expect("open volume");
    vol.write_all_at(&new, MIB).expect("overwrite");
    vol.sync_all().expect("fsync");
    let names: Vec<String> = fs::read_dir(mnt.path().join("snapshots"))
        .expect("readdir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, vec!["vm@before".to_string()]);
    let snap = mnt.path().join("snapshots/vm@before");
    assert!(
        fs::read(&snap).expect("read snapshot") == old,
        "snapshot content changed"
    );
    let now = fs::read(mnt.path().join("volumes/vm")).expect("read volume");
    assert!(now[MIB as usize..2 * MIB as usize] == new[..]);
    let err = fs::OpenOptions::new()
        .write(true)
        .open(&snap)
        .expect_err("a snapshot opened for writing");
    assert!(
        matches!(err.raw_os_error(), Some(libc::EROFS) | Some(libc::EACCES)),
        "{err}"
    );
    drop(vol);
    drop(m);
}

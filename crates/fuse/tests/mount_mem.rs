//! The FUSE mount on the real /dev/fuse, over the in-memory catalog: every test mounts a file
//! system on a temporary directory and uses it through ordinary system calls and tools.

mod common;

use common::{errno, image, pseudo_random, TestMount, BLOCK};
use condense_api::mem::{MemBlock, MemCatalog};
use condense_api::{Catalog, ExtentKind};
use condense_fuse::MountOptions;
use nix::fcntl::{fallocate, FallocateFlags};
use nix::unistd::{lseek, Whence};
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

const MIB: u64 = 1 << 20;

fn run(cmd: &mut Command) {
    let out = cmd.output().expect("run command");
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn file_volumes(cat: &MemCatalog) -> Vec<String> {
    cat.list()
        .expect("list")
        .into_iter()
        .map(|v| v.name)
        .filter(|n| n.starts_with(".file."))
        .collect()
}

#[test]
fn layout_shows_volumes_but_not_hidden_ones() {
    if !common::fuse_usable() {
        return;
    }
    let cat = Arc::new(MemCatalog::new(BLOCK as u32));
    cat.create("disk-a", 8 * MIB).expect("create");
    cat.create("disk-b", 4 * MIB).expect("create");
    cat.create(".file.99999", BLOCK).expect("create");
    let m = TestMount::with_catalog(cat, MountOptions::default());
    let mut top: Vec<String> = fs::read_dir(m.root())
        .expect("readdir")
        .map(|e| e.expect("entry").file_name().into_string().expect("utf8"))
        .collect();
    top.sort();
    assert_eq!(top, ["files", "snapshots", "volumes"]);
    let mut vols: Vec<String> = fs::read_dir(m.root().join("volumes"))
        .expect("readdir")
        .map(|e| e.expect("entry").file_name().into_string().expect("utf8"))
        .collect();
    vols.sort();
    assert_eq!(vols, ["disk-a", "disk-b"]);
    assert_eq!(
        fs::metadata(m.volume("disk-a")).expect("stat").len(),
        8 * MIB
    );
    assert!(fs::metadata(m.volume(".file.99999")).is_err());
    // The orphan content volume (no inode names it) was deleted at mount.
    assert!(file_volumes(&m.catalog).is_empty());
    // volumes/ is managed by the CLI, not by file operations.
    let e = File::create(m.volume("new")).expect_err("create in volumes/");
    assert_eq!(errno(&e), libc::EPERM);
    let e = fs::remove_file(m.volume("disk-b")).expect_err("unlink in volumes/");
    assert_eq!(errno(&e), libc::EPERM);
}

#[test]
fn images_copied_with_cp_read_back_identical() {
    if !common::fuse_usable() {
        return;
    }
    let m = TestMount::new();
    let src = tempfile::tempdir().expect("temp dir");
    let mut images = Vec::new();
    for i in 0..4u64 {
        let data = image(i + 1, 700 + 300 * i as usize);
        let path = src.path().join(format!("vm{i}.img"));
        fs::write(&path, &data).expect("write source");
        images.push((path, data));
    }
    let dest = m.files().join("images");
    fs::create_dir(&dest).expect("mkdir");
    let mut cp = Command::new("cp");
    for (path, _) in &images {
        cp.arg(path);
    }
    run(cp.arg(&dest));
    for (path, data) in &images {
        let copy = dest.join(path.file_name().expect("name"));
        let back = fs::read(&copy).expect("read back");
        assert_eq!(back.len(), data.len());
        assert!(
            back == *data,
            "{} differs after the round trip",
            copy.display()
        );
        run(Command::new("cmp").arg(path).arg(&copy));
        let meta = fs::metadata(&copy).expect("stat");
        assert_eq!(meta.len(), data.len() as u64);
        // du counts data blocks only: every fifth block of these images is zeros.
        let zero_blocks = data
            .chunks(BLOCK as usize)
            .filter(|c| c.len() == BLOCK as usize && c.iter().all(|&b| b == 0))
            .count() as u64;
        let data_bytes = data.len() as u64 - zero_blocks * BLOCK;
        let du_bytes = meta.blocks() * 512;
        assert!(
            du_bytes >= data_bytes && du_bytes <= data_bytes + BLOCK,
            "du {du_bytes} vs data {data_bytes}"
        );
    }
    // Each file keeps its content in one hidden volume.
    assert_eq!(file_volumes(&m.catalog).len(), images.len());
    // A copy with a small buffer and odd offsets goes through the same paths.
    run(Command::new("dd")
        .arg(format!("if={}", images[0].0.display()))
        .arg(format!("of={}", dest.join("dd.img").display()))
        .args(["bs=3000", "status=none"]));
    assert!(fs::read(dest.join("dd.img")).expect("read") == images[0].1);
}

#[test]
fn namespace_operations_and_their_errors() {
    if !common::fuse_usable() {
        return;
    }
    let m = TestMount::new();
    let f = m.files();
    fs::create_dir_all(f.join("a/b")).expect("mkdir -p");
    fs::write(f.join("a/b/file"), b"hello").expect("write");
    // rmdir of a non-empty directory.
    let e = fs::remove_dir(f.join("a")).expect_err("rmdir non-empty");
    assert_eq!(errno(&e), libc::ENOTEMPTY);
    // Names longer than 255 bytes.
    let long = "x".repeat(256);
    let e = File::create(f.join(&long)).expect_err("long name");
    assert_eq!(errno(&e), libc::ENAMETOOLONG);
    let e = fs::create_dir(f.join(&long)).expect_err("long dir name");
    assert_eq!(errno(&e), libc::ENAMETOOLONG);
    fs::write(f.join("x".repeat(255)), b"ok").expect("255-byte name");
    // rename of a file, over a file, and of a directory.
    fs::rename(f.join("a/b/file"), f.join("moved")).expect("rename");
    assert_eq!(fs::read(f.join("moved")).expect("read"), b"hello");
    assert!(!f.join("a/b/file").exists());
    fs::write(f.join("other"), b"other content").expect("write");
    fs::rename(f.join("other"), f.join("moved")).expect("rename over");
    assert_eq!(fs::read(f.join("moved")).expect("read"), b"other content");
    assert_eq!(
        file_volumes(&m.catalog).len(),
        2,
        "the replaced file's volume is gone"
    );
    fs::rename(f.join("a/b"), f.join("b2")).expect("rename dir");
    let e = fs::rename(f.join("a"), f.join("b2/inside")).map(|_| ());
    assert!(e.is_ok(), "moving a into b2 is allowed");
    let e = fs::rename(f.join("b2"), f.join("b2/inside/loop")).expect_err("into itself");
    assert_eq!(errno(&e), libc::EINVAL);
    let e = fs::rename(f.join("moved"), m.volume("moved")).expect_err("across areas");
    assert_eq!(errno(&e), libc::EXDEV);
    // unlink, rmdir.
    fs::remove_file(f.join("moved")).expect("unlink");
    let e = fs::remove_file(f.join("moved")).expect_err("unlink twice");
    assert_eq!(errno(&e), libc::ENOENT);
    fs::remove_dir(f.join("b2/inside")).expect("rmdir");
    // chmod, chown, mtime.
    fs::write(f.join("p"), b"p").expect("write");
    fs::set_permissions(f.join("p"), fs::Permissions::from_mode(0o600)).expect("chmod");
    assert_eq!(
        fs::metadata(f.join("p")).expect("stat").mode() & 0o7777,
        0o600
    );
    run(Command::new("touch")
        .args(["-m", "-d", "2001-02-03 04:05:06 UTC"])
        .arg(f.join("p")));
    assert_eq!(
        fs::metadata(f.join("p")).expect("stat").mtime(),
        981_173_106
    );
    if nix::unistd::geteuid().is_root() {
        std::os::unix::fs::chown(f.join("p"), Some(1234), Some(5678)).expect("chown");
        let meta = fs::metadata(f.join("p")).expect("stat");
        assert_eq!((meta.uid(), meta.gid()), (1234, 5678));
    }
    // Symbolic links.
    std::os::unix::fs::symlink("p", f.join("link")).expect("symlink");
    assert_eq!(
        fs::read_link(f.join("link")).expect("readlink"),
        Path::new("p")
    );
    assert_eq!(fs::read(f.join("link")).expect("read via link"), b"p");
    // Directory link counts: files/ holds one subdirectory (b2).
    assert_eq!(fs::metadata(&f).expect("stat").nlink(), 3);
    let mut names: Vec<String> = fs::read_dir(&f)
        .expect("readdir")
        .map(|e| e.expect("entry").file_name().into_string().expect("utf8"))
        .collect();
    names.sort();
    assert_eq!(names, ["b2", "link", "p", &"x".repeat(255)]);
}

#[test]
fn volume_file_io_bounds_and_truncate() {
    if !common::fuse_usable() {
        return;
    }
    let cat = Arc::new(MemCatalog::new(BLOCK as u32));
    cat.create("disk", 4 * MIB).expect("create");
    let m = TestMount::with_catalog(cat.clone(), MountOptions::default());
    let path = m.volume("disk");
    let data = pseudo_random(3, 100_000);
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .expect("open");
    f.write_all_at(&data, 12_345).expect("write");
    f.sync_all().expect("fsync");
    f.sync_data().expect("fdatasync");
    let mut back = vec![0u8; data.len()];
    f.read_exact_at(&mut back, 12_345).expect("read");
    assert!(back == data);
    let vol = cat.open("disk").expect("open volume");
    let mut direct = vec![0u8; data.len()];
    vol.read(12_345, &mut direct).expect("volume read");
    assert!(
        direct == data,
        "the volume holds what was written through the file"
    );

    // Writes past the end: ENOSPC, and nothing is written.
    let tail_before = {
        let mut t = vec![0u8; 8192];
        vol.read(4 * MIB - 8192, &mut t).expect("read tail");
        t
    };
    let e = f
        .write_at(&[1u8; 10], 4 * MIB)
        .expect_err("write at the end");
    assert_eq!(errno(&e), libc::ENOSPC);
    // A write straddling the end fails with ENOSPC and changes nothing, or (when the kernel
    // splits it into page-sized requests, which it may do under memory pressure) is a short
    // write of what fits, and nothing past the end is written either way.
    let mut tail_after_write = tail_before.clone();
    match f.write_at(&[1u8; 8192], 4 * MIB - 4096) {
        Err(e) => assert_eq!(errno(&e), libc::ENOSPC),
        Ok(n) => {
            assert!(n <= 4096, "straddling write wrote {n} bytes, past the end");
            tail_after_write[4096..4096 + n].fill(1);
            let e = f
                .write_at(&[1u8; 10], 4 * MIB)
                .expect_err("the rest of a short write");
            assert_eq!(errno(&e), libc::ENOSPC);
        }
    }
    let mut t = vec![0u8; 8192];
    vol.read(4 * MIB - 8192, &mut t).expect("read tail");
    assert_eq!(t, tail_after_write, "a refused write changed nothing");
    assert_eq!(fs::metadata(&path).expect("stat").len(), 4 * MIB);
    // Reads stop at the end.
    let mut r = File::open(&path).expect("open");
    r.seek(SeekFrom::Start(4 * MIB - 10)).expect("seek");
    let mut rest = Vec::new();
    r.read_to_end(&mut rest).expect("read to end");
    assert_eq!(rest.len(), 10);

    // Truncate is refused: volumes are resized with the CLI.
    let e = f.set_len(MIB).expect_err("truncate");
    assert_eq!(errno(&e), libc::EPERM);
    let e = OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(&path)
        .expect_err("O_TRUNC");
    assert_eq!(errno(&e), libc::EPERM);
    assert_eq!(fs::metadata(&path).expect("stat").len(), 4 * MIB);
    f.set_len(4 * MIB)
        .expect("truncate to the same size is a no-op");
    assert!(vol.block_status(12_345, 100).expect("status")[0].kind == ExtentKind::Data);

    // A resize made by the CLI shows as the new size once the kernel's attribute cache
    // (1 s) expires.
    cat.resize("disk", 8 * MIB, false).expect("resize");
    std::thread::sleep(std::time::Duration::from_millis(1100));
    assert_eq!(fs::metadata(&path).expect("stat").len(), 8 * MIB);
    f.write_all_at(b"grown", 6 * MIB)
        .expect("write in the grown part");
}

#[test]
fn volume_holes_seek_punch_and_zero_range() {
    if !common::fuse_usable() {
        return;
    }
    let cat = Arc::new(MemCatalog::new(BLOCK as u32));
    cat.create("disk", 64 * BLOCK).expect("create");
    let m = TestMount::with_catalog(cat.clone(), MountOptions::default());
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.volume("disk"))
        .expect("open");
    // Data in blocks 8..16 and 40..41.
    f.write_all_at(&pseudo_random(1, 8 * BLOCK as usize), 8 * BLOCK)
        .expect("write");
    f.write_all_at(&pseudo_random(2, BLOCK as usize), 40 * BLOCK)
        .expect("write");
    let b = |n: u64| (n * BLOCK) as i64;
    assert_eq!(lseek(&f, 0, Whence::SeekData).expect("data"), b(8));
    assert_eq!(
        lseek(&f, b(8) + 5, Whence::SeekData).expect("data"),
        b(8) + 5
    );
    assert_eq!(lseek(&f, b(8), Whence::SeekHole).expect("hole"), b(16));
    assert_eq!(lseek(&f, b(16), Whence::SeekData).expect("data"), b(40));
    assert_eq!(lseek(&f, b(41), Whence::SeekHole).expect("hole"), b(41));
    assert_eq!(
        lseek(&f, b(41), Whence::SeekData),
        Err(nix::errno::Errno::ENXIO)
    );
    assert_eq!(
        lseek(&f, b(64), Whence::SeekHole),
        Err(nix::errno::Errno::ENXIO)
    );
    // st_blocks counts the 9 data blocks.
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let meta = fs::metadata(m.volume("disk")).expect("stat");
    assert_eq!(meta.blocks() * 512, 9 * BLOCK);

    // Punch a hole over blocks 10..12 plus half a block: whole blocks are released.
    let punch = FallocateFlags::FALLOC_FL_PUNCH_HOLE | FallocateFlags::FALLOC_FL_KEEP_SIZE;
    fallocate(&f, punch, b(10), b(2) + 2048).expect("punch hole");
    let mem = cat.open_mem("disk").expect("open");
    let blocks = mem.blocks();
    assert!(!blocks.contains_key(&10) && !blocks.contains_key(&11));
    assert!(matches!(blocks.get(&12), Some(MemBlock::Data(_))));
    let mut buf = vec![1u8; (2 * BLOCK + 2048) as usize];
    f.read_exact_at(&mut buf, 10 * BLOCK).expect("read");
    assert!(buf.iter().all(|&x| x == 0), "a punched range reads zeros");
    assert_eq!(lseek(&f, b(8), Whence::SeekHole).expect("hole"), b(10));
    // Zero a range: it stays allocated (Zero), reads zeros, and is a hole for SEEK_HOLE.
    fallocate(&f, FallocateFlags::FALLOC_FL_ZERO_RANGE, b(13), b(2)).expect("zero range");
    assert!(matches!(mem.blocks().get(&13), Some(MemBlock::Zero)));
    f.read_exact_at(&mut buf[..(2 * BLOCK) as usize], 13 * BLOCK)
        .expect("read");
    assert!(buf[..(2 * BLOCK) as usize].iter().all(|&x| x == 0));
    assert_eq!(lseek(&f, b(12), Whence::SeekHole).expect("hole"), b(13));
    // fallocate that would grow the volume is refused; unknown modes are not supported.
    let e = fallocate(&f, FallocateFlags::empty(), b(60), b(8)).expect_err("grow");
    assert_eq!(e, nix::errno::Errno::ENOSPC);
    let e = fallocate(&f, FallocateFlags::FALLOC_FL_COLLAPSE_RANGE, 0, b(1)).expect_err("collapse");
    assert_eq!(e, nix::errno::Errno::EOPNOTSUPP);
}

#[test]
fn file_truncate_holes_and_punch() {
    if !common::fuse_usable() {
        return;
    }
    let m = TestMount::new();
    let path = m.files().join("sparse");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .expect("create");
    // A sparse file: 1 MiB hole, then data.
    f.write_all_at(&pseudo_random(9, 3 * BLOCK as usize), MIB)
        .expect("write");
    assert_eq!(f.metadata().expect("stat").len(), MIB + 3 * BLOCK);
    assert_eq!(lseek(&f, 0, Whence::SeekData).expect("data"), MIB as i64);
    assert_eq!(
        lseek(&f, MIB as i64, Whence::SeekHole).expect("hole"),
        (MIB + 3 * BLOCK) as i64
    );
    let mut head = vec![1u8; 4096];
    f.read_exact_at(&mut head, 0).expect("read hole");
    assert!(head.iter().all(|&b| b == 0));
    // Punch the middle data block.
    let punch = FallocateFlags::FALLOC_FL_PUNCH_HOLE | FallocateFlags::FALLOC_FL_KEEP_SIZE;
    fallocate(&f, punch, (MIB + BLOCK) as i64, BLOCK as i64).expect("punch");
    assert_eq!(
        lseek(&f, MIB as i64, Whence::SeekHole).expect("hole"),
        (MIB + BLOCK) as i64
    );
    assert_eq!(
        f.metadata().expect("stat").len(),
        MIB + 3 * BLOCK,
        "size kept"
    );
    // Shrink to the middle of a block, then grow: the cut-off bytes read as zeros.
    f.set_len(MIB + 100).expect("shrink");
    f.set_len(MIB + 3 * BLOCK).expect("grow");
    let mut back = vec![1u8; 3 * BLOCK as usize];
    f.read_exact_at(&mut back, MIB).expect("read");
    assert_eq!(&back[..100], &pseudo_random(9, 100)[..]);
    assert!(back[100..].iter().all(|&b| b == 0));
    // fallocate without KEEP_SIZE extends the length.
    fallocate(&f, FallocateFlags::empty(), 0, (2 * MIB) as i64).expect("allocate");
    assert_eq!(f.metadata().expect("stat").len(), 2 * MIB);
    // Appends grow the content volume in steps, not per write.
    let mut a = OpenOptions::new()
        .append(true)
        .open(&path)
        .expect("open append");
    for i in 0..64u64 {
        a.write_all(&pseudo_random(i, 10_000)).expect("append");
    }
    drop(a);
    assert_eq!(f.metadata().expect("stat").len(), 2 * MIB + 640_000);
    let vol = m.catalog.list().expect("list");
    let content = vol
        .iter()
        .find(|v| v.name.starts_with(".file."))
        .expect("content volume");
    assert!(content.size_bytes >= 2 * MIB + 640_000);
    assert!(content.size_bytes <= 4 * (2 * MIB + 640_000) + BLOCK);
}

#[test]
fn tree_survives_unmount_and_remount() {
    if !common::fuse_usable() {
        return;
    }
    let m = TestMount::new();
    let f = m.files();
    fs::create_dir(f.join("dir")).expect("mkdir");
    let big = image(5, 500);
    fs::write(f.join("dir/big.img"), &big).expect("write");
    fs::write(f.join("small"), b"small file").expect("write");
    fs::set_permissions(f.join("small"), fs::Permissions::from_mode(0o640)).expect("chmod");
    std::os::unix::fs::symlink("dir/big.img", f.join("link")).expect("symlink");
    fs::remove_file(f.join("small")).ok();
    fs::write(f.join("small"), b"small file, second version").expect("write");
    let mtime = fs::metadata(f.join("dir/big.img")).expect("stat").mtime();
    let cat = m.unmount();

    let m = TestMount::with_catalog(cat.clone(), MountOptions::default());
    let f = m.files();
    assert!(fs::read(f.join("dir/big.img")).expect("read") == big);
    assert_eq!(
        fs::read(f.join("small")).expect("read"),
        b"small file, second version"
    );
    assert_eq!(
        fs::read_link(f.join("link")).expect("readlink"),
        Path::new("dir/big.img")
    );
    assert_eq!(
        fs::metadata(f.join("dir/big.img")).expect("stat").mtime(),
        mtime
    );
    assert_eq!(file_volumes(&cat).len(), 2);
    // And a third time, read-only: everything is there and nothing can change.
    let cat = m.unmount();
    let ro = MountOptions {
        read_only: true,
        ..MountOptions::default()
    };
    let m = TestMount::with_catalog(cat, ro);
    let f = m.files();
    assert!(fs::read(f.join("dir/big.img")).expect("read") == big);
    let e = fs::write(f.join("new"), b"x").expect_err("write on read-only");
    assert_eq!(errno(&e), libc::EROFS);
    let e = fs::remove_file(f.join("small")).expect_err("unlink on read-only");
    assert_eq!(errno(&e), libc::EROFS);
}

#[test]
fn unlinked_open_file_stays_readable_until_closed() {
    if !common::fuse_usable() {
        return;
    }
    let m = TestMount::new();
    let path = m.files().join("f");
    let data = pseudo_random(4, 50_000);
    fs::write(&path, &data).expect("write");
    let f = File::open(&path).expect("open");
    fs::remove_file(&path).expect("unlink");
    assert!(!path.exists());
    let mut back = vec![0u8; data.len()];
    f.read_exact_at(&mut back, 0).expect("read after unlink");
    assert!(back == data);
    assert_eq!(file_volumes(&m.catalog).len(), 1);
    // While a file is open the mount is busy.
    let mounted = m.mounted.as_ref().expect("mounted");
    match mounted.unmounter().unmount() {
        Err(condense_fuse::FuseError::Busy { .. }) => {}
        other => panic!("expected Busy, got {other:?}"),
    }
    drop(f);
    // The last close released the content.
    for _ in 0..50 {
        if file_volumes(&m.catalog).is_empty() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(file_volumes(&m.catalog).is_empty());
    m.unmount();
}

#[test]
fn statfs_reports_the_pool() {
    if !common::fuse_usable() {
        return;
    }
    let m = TestMount::new();
    let st = nix::sys::statvfs::statvfs(m.root()).expect("statvfs");
    let usage = m.catalog.usage().expect("usage");
    assert_eq!(st.block_size(), u64::from(usage.block_size));
    assert_eq!(st.name_max(), 255);
    assert_eq!(
        st.blocks_available() * st.fragment_size(),
        usage.available_bytes / BLOCK * BLOCK
    );
}

#[test]
fn concurrent_writers_to_one_file_and_many_files() {
    if !common::fuse_usable() {
        return;
    }
    let m = TestMount::new();
    let shared = m.files().join("shared");
    File::create(&shared).expect("create");
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let shared = shared.clone();
            let own = m.files().join(format!("own{t}"));
            s.spawn(move || {
                let f = OpenOptions::new().write(true).open(&shared).expect("open");
                for i in 0..32u64 {
                    let at = (i * 4 + t) * 65_536;
                    f.write_all_at(&pseudo_random(at, 65_536), at)
                        .expect("write");
                }
                fs::write(&own, pseudo_random(t, 300_000)).expect("write own");
            });
        }
    });
    let all = fs::read(&shared).expect("read");
    assert_eq!(all.len(), 128 * 65_536);
    for (i, chunk) in all.chunks(65_536).enumerate() {
        assert!(
            chunk == pseudo_random(i as u64 * 65_536, 65_536),
            "chunk {i}"
        );
    }
    for t in 0..4u64 {
        assert!(
            fs::read(m.files().join(format!("own{t}"))).expect("read") == pseudo_random(t, 300_000)
        );
    }
    let _ = OpenOptionsExt::mode(&mut OpenOptions::new(), 0o600);
}

/// Names in a directory, sorted.
fn names_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .expect("readdir")
        .map(|e| e.expect("entry").file_name().into_string().expect("utf8"))
        .collect();
    names.sort();
    names
}

/// The errno a change to a read-only snapshot file gets when the kernel lets the request
/// through: root always reaches the mount (EROFS); other users are stopped by the kernel's
/// check of the file's read-only mode first (EACCES).
fn write_refusal() -> i32 {
    if nix::unistd::geteuid().is_root() {
        libc::EROFS
    } else {
        libc::EACCES
    }
}

#[test]
fn snapshot_files_read_the_frozen_content_and_refuse_changes() {
    if !common::fuse_usable() {
        return;
    }
    let cat = Arc::new(MemCatalog::new(BLOCK as u32));
    let size = 2 * MIB;
    cat.create("disk", size).expect("create");
    let old = pseudo_random(11, (MIB + 3 * BLOCK) as usize);
    {
        let vol = cat.open("disk").expect("open");
        // Data in the first MiB + 3 blocks; the rest is a hole.
        vol.write(0, &old, false).expect("write");
    }
    cat.snapshot_create("disk", "before").expect("snapshot");
    // A hidden volume and its snapshot stay hidden.
    cat.create(".hidden", BLOCK).expect("create");
    cat.snapshot_create(".hidden", "s").expect("snapshot");
    let info = cat
        .snapshots()
        .expect("snapshots")
        .into_iter()
        .find(|s| s.full_name() == "disk@before")
        .expect("listed");
    let m = TestMount::with_catalog(cat.clone(), MountOptions::default());
    let snaps = m.root().join("snapshots");
    let snap = snaps.join("disk@before");
    assert_eq!(names_in(&snaps), ["disk@before"]);
    assert!(fs::metadata(snaps.join(".hidden@s")).is_err());
    // volumes/ does not show snapshots, even by name.
    assert_eq!(names_in(&m.root().join("volumes")), ["disk"]);
    let e = fs::metadata(m.volume("disk@before")).expect_err("snapshot in volumes/");
    assert_eq!(errno(&e), libc::ENOENT);

    // Overwrite part of the volume through the mount.
    let new_part = pseudo_random(12, (3 * BLOCK + 100) as usize);
    let at = 5 * BLOCK - 50;
    {
        let f = OpenOptions::new()
            .write(true)
            .open(m.volume("disk"))
            .expect("open volume");
        f.write_all_at(&new_part, at).expect("overwrite");
        f.sync_all().expect("fsync");
    }
    let mut new = old.clone();
    new.resize(size as usize, 0);
    new[at as usize..at as usize + new_part.len()].copy_from_slice(&new_part);
    let mut old_full = old.clone();
    old_full.resize(size as usize, 0);
    let snap_bytes = fs::read(&snap).expect("read snapshot");
    assert_eq!(snap_bytes.len() as u64, size);
    assert!(snap_bytes == old_full, "the snapshot reads the old content");
    let vol_bytes = fs::read(m.volume("disk")).expect("read volume");
    assert!(vol_bytes == new, "the volume reads the new content");

    // Attributes: size, read-only mode, creation time, du.
    let meta = fs::metadata(&snap).expect("stat");
    assert!(meta.is_file());
    assert_eq!(meta.len(), size);
    assert_eq!(
        meta.mode() & 0o7777,
        0o400,
        "owner-only by default (umask 077)"
    );
    assert_eq!(
        fs::metadata(m.volume("disk")).expect("stat").mode() & 0o7777,
        0o600
    );
    assert_eq!(fs::metadata(m.root()).expect("stat").mode() & 0o7777, 0o700);
    assert_eq!(meta.mtime(), info.created_unix as i64);
    assert_eq!(meta.ctime(), info.created_unix as i64);
    assert_eq!(meta.blocks() * 512, MIB + 3 * BLOCK);

    // SEEK_DATA / SEEK_HOLE.
    let f = File::open(&snap).expect("open snapshot");
    assert_eq!(lseek(&f, 0, Whence::SeekData).expect("data"), 0);
    let data_end = (MIB + 3 * BLOCK) as i64;
    assert_eq!(lseek(&f, 0, Whence::SeekHole).expect("hole"), data_end);
    assert_eq!(
        lseek(&f, data_end, Whence::SeekData),
        Err(nix::errno::Errno::ENXIO)
    );

    // Every change is refused.
    let refused = write_refusal();
    let e = OpenOptions::new()
        .write(true)
        .open(&snap)
        .expect_err("open for writing");
    assert_eq!(errno(&e), refused);
    let e = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&snap)
        .expect_err("open read-write");
    assert_eq!(errno(&e), refused);
    let e = nix::unistd::truncate(&snap, 0).expect_err("truncate");
    assert_eq!(e as i32, refused);
    let e = f
        .set_len(0)
        .expect_err("ftruncate on a read-only descriptor");
    assert_eq!(errno(&e), libc::EINVAL);
    let e = fs::remove_file(&snap).expect_err("unlink");
    assert_eq!(errno(&e), libc::EROFS);
    let e = fs::rename(&snap, snaps.join("disk@renamed")).expect_err("rename");
    assert_eq!(errno(&e), libc::EROFS);
    let e = fs::rename(&snap, m.files().join("moved")).expect_err("rename out");
    assert_eq!(errno(&e), libc::EROFS);
    let e = File::create(snaps.join("disk@new")).expect_err("create");
    assert_eq!(errno(&e), libc::EROFS);
    let e = fs::create_dir(snaps.join("dir")).expect_err("mkdir");
    assert_eq!(errno(&e), libc::EROFS);
    let e = fs::set_permissions(&snap, fs::Permissions::from_mode(0o644)).expect_err("chmod");
    assert_eq!(errno(&e), libc::EROFS);
    // Nothing changed.
    assert!(fs::read(&snap).expect("read snapshot") == old_full);
    assert_eq!(
        cat.snapshots().expect("snapshots").len(),
        2,
        "both snapshots are still there"
    );
    // Copying a snapshot out is the way to get a writable copy.
    fs::copy(&snap, m.files().join("copy")).expect("cp out");
    assert!(fs::read(m.files().join("copy")).expect("read copy") == old_full);
}

#[test]
fn snapshots_taken_or_deleted_while_mounted_show_and_vanish() {
    if !common::fuse_usable() {
        return;
    }
    let cat = Arc::new(MemCatalog::new(BLOCK as u32));
    let size = 8 * MIB;
    cat.create("disk", size).expect("create");
    cat.create(".hidden", BLOCK).expect("create");
    let content = pseudo_random(21, size as usize);
    cat.open("disk")
        .expect("open")
        .write(0, &content, false)
        .expect("write");
    let m = TestMount::with_catalog(cat.clone(), MountOptions::default());
    let snaps = m.root().join("snapshots");
    assert!(names_in(&snaps).is_empty());

    // Taken after mounting: shows at the next readdir.
    cat.snapshot_create("disk", "a").expect("snapshot");
    cat.snapshot_create(".hidden", "x").expect("snapshot");
    assert_eq!(names_in(&snaps), ["disk@a"]);
    let e = fs::metadata(snaps.join(".hidden@x")).expect_err("hidden");
    assert_eq!(errno(&e), libc::ENOENT);
    cat.snapshot_create("disk", "b").expect("snapshot");
    assert_eq!(names_in(&snaps), ["disk@a", "disk@b"]);
    // A lookup by name finds one without a readdir first.
    cat.snapshot_create("disk", "c").expect("snapshot");
    assert_eq!(
        fs::metadata(snaps.join("disk@c")).expect("stat").len(),
        size
    );

    // An open snapshot file reads until the snapshot is deleted.
    let f = File::open(snaps.join("disk@a")).expect("open");
    let mut head = vec![0u8; 4096];
    f.read_exact_at(&mut head, 0).expect("read");
    assert!(head[..] == content[..4096]);
    cat.snapshot_delete("disk", "a").expect("delete");
    assert_eq!(names_in(&snaps), ["disk@b", "disk@c"]);
    // Far from what was read (and read ahead) before: the read reaches the mount.
    let mut buf = vec![0u8; 4096];
    let e = f
        .read_exact_at(&mut buf, 6 * MIB)
        .expect_err("read a deleted snapshot");
    assert!(
        [libc::ENOENT, libc::EIO].contains(&errno(&e)),
        "read of a deleted snapshot: {e}"
    );
    drop(f);
    // Once the kernel's entry cache (1 s) expires, the name is gone too.
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let e = fs::metadata(snaps.join("disk@a")).expect_err("stat a deleted snapshot");
    assert_eq!(errno(&e), libc::ENOENT);

    // Deleted behind a file the kernel has not looked at again: getattr notices within 1 s.
    let before = fs::metadata(snaps.join("disk@b")).expect("stat");
    assert_eq!(before.len(), size);
    cat.snapshot_delete("disk", "b").expect("delete");
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let e = fs::metadata(snaps.join("disk@b")).expect_err("stat");
    assert_eq!(errno(&e), libc::ENOENT);

    // Taken again under the same name: shows the volume as it is now.
    cat.open("disk")
        .expect("open")
        .write(0, &[0xAB; 4096], false)
        .expect("write");
    cat.snapshot_create("disk", "a").expect("snapshot again");
    let mut again = vec![0u8; 4096];
    File::open(snaps.join("disk@a"))
        .expect("open")
        .read_exact_at(&mut again, 0)
        .expect("read");
    assert_eq!(again, vec![0xAB; 4096]);
    assert_eq!(names_in(&snaps), ["disk@a", "disk@c"]);
}

#[test]
fn snapshots_are_readable_on_a_read_only_mount() {
    if !common::fuse_usable() {
        return;
    }
    let cat = Arc::new(MemCatalog::new(BLOCK as u32));
    cat.create("disk", 16 * BLOCK).expect("create");
    let data = pseudo_random(31, (16 * BLOCK) as usize);
    cat.open("disk")
        .expect("open")
        .write(0, &data, false)
        .expect("write");
    cat.snapshot_create("disk", "s").expect("snapshot");
    let opts = MountOptions {
        read_only: true,
        ..MountOptions::default()
    };
    let m = TestMount::with_catalog(cat, opts);
    let snap = m.root().join("snapshots/disk@s");
    assert!(fs::read(&snap).expect("read") == data);
    let e = fs::remove_file(&snap).expect_err("unlink");
    assert_eq!(errno(&e), libc::EROFS);
}

/// The `max_ratio` of the backing device of the mount at `root` (root's device).
fn dirty_max_ratio(root: &Path) -> u32 {
    let dev = fs::metadata(root).expect("stat mount").dev();
    let path = format!(
        "/sys/class/bdi/{}:{}/max_ratio",
        nix::sys::stat::major(dev),
        nix::sys::stat::minor(dev)
    );
    fs::read_to_string(&path)
        .expect("read max_ratio")
        .trim()
        .parse()
        .expect("a number")
}

/// With the writeback cache the mount raises its dirty-page limit (the kernel's 1 % for FUSE
/// throttled buffered writers: docs/FUSE.md), and 4 KiB pages written buffered in random
/// order, many of them twice, are all in the pool once fsynced.
#[test]
fn writeback_cache_raises_the_dirty_limit_and_keeps_fsynced_pages() {
    if !common::fuse_usable() {
        return;
    }
    let opts = MountOptions {
        writeback_cache: true,
        ..MountOptions::default()
    };
    let m = TestMount::with_catalog(Arc::new(MemCatalog::new(BLOCK as u32)), opts);
    if nix::unistd::geteuid().is_root() {
        assert_eq!(
            dirty_max_ratio(m.root()),
            condense_fuse::WRITEBACK_MAX_RATIO
        );
    } else {
        eprintln!("not root: the mount's dirty limit is not checked (only root may set it)");
    }
    let len = 8 * MIB as usize;
    let pages = len / BLOCK as usize;
    let mut want = vec![0u8; len];
    let path = m.files().join("random.dat");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .expect("create");
    f.set_len(len as u64).expect("set_len");
    let order = pseudo_random(42, 3 * pages * 8);
    for (i, word) in order.chunks_exact(8).enumerate() {
        let n = u64::from_le_bytes(word.try_into().expect("8 bytes"));
        let at = (n % pages as u64) as usize * BLOCK as usize;
        let page = pseudo_random(1000 + i as u64, BLOCK as usize);
        want[at..at + page.len()].copy_from_slice(&page);
        f.write_all_at(&page, at as u64).expect("write page");
    }
    f.sync_all().expect("fsync");
    drop(f);
    // Remounted without the cache: what is read comes from the pool.
    let again = TestMount::with_catalog(m.unmount(), MountOptions::default());
    assert!(fs::read(again.files().join("random.dat")).expect("read back") == want);
}

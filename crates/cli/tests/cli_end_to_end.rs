//! The `condense` binary end to end: import/export round trips, stats against `du`, bad input,
//! corruption, kill -9 during import, and a full disk.

use std::fs::{self, File};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

mod common;
use common::*;

fn make_image(path: &Path, size: u64, parts: &[(u64, Vec<u8>)]) {
    let f = File::create(path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    f.set_len(size).unwrap_or_else(|e| panic!("set_len: {e}"));
    for (off, data) in parts {
        f.write_all_at(data, *off)
            .unwrap_or_else(|e| panic!("write: {e}"));
    }
}

/// Data extents of a file via SEEK_DATA/SEEK_HOLE.
fn data_extents(path: &Path) -> Vec<(u64, u64)> {
    use std::os::fd::AsRawFd;
    let f = File::open(path).unwrap_or_else(|e| panic!("open: {e}"));
    let size = f.metadata().map(|m| m.len()).unwrap_or(0) as i64;
    let fd = f.as_raw_fd();
    let mut out = Vec::new();
    let mut pos = 0i64;
    while pos < size {
        // SAFETY: lseek on an open descriptor.
        let d = unsafe { libc::lseek(fd, pos, libc::SEEK_DATA) };
        if d < 0 {
            break;
        }
        let h = unsafe { libc::lseek(fd, d, libc::SEEK_HOLE) };
        out.push((d as u64, (h - d) as u64));
        pos = h;
    }
    out
}

fn same_bytes(a: &Path, b: &Path) -> bool {
    let (Ok(fa), Ok(fb)) = (File::open(a), File::open(b)) else {
        return false;
    };
    let (la, lb) = (
        fa.metadata().map(|m| m.len()).unwrap_or(0),
        fb.metadata().map(|m| m.len()).unwrap_or(1),
    );
    if la != lb {
        return false;
    }
    let mut ba = vec![0u8; 8 << 20];
    let mut bb = vec![0u8; 8 << 20];
    let mut pos = 0;
    while pos < la {
        let n = (8 << 20).min(la - pos) as usize;
        if fa.read_exact_at(&mut ba[..n], pos).is_err()
            || fb.read_exact_at(&mut bb[..n], pos).is_err()
            || ba[..n] != bb[..n]
        {
            return false;
        }
        pos += n as u64;
    }
    true
}

fn du_sb(dir: &Path) -> u64 {
    fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok()?.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// A multi-GiB sparse image with unique, duplicated, compressible and zero-filled data.
fn realistic_image(path: &Path, seed: u64) {
    let mut rng = Rng(seed);
    let unique = rng.bytes(24 << 20);
    let text: Vec<u8> = b"condense keeps virtual machine disks small. "
        .iter()
        .cycle()
        .take(16 << 20)
        .copied()
        .collect();
    make_image(
        path,
        3 << 30,
        &[
            (0, rng.bytes(1 << 20)),
            (100 << 20, unique.clone()),
            (1 << 30, unique),        // the same data again: deduplicated
            ((2 << 30) + 4096, text), // compressible, not block-aligned at the end
            ((5 << 29) + 123, vec![0u8; 8 << 20]), // explicit zeros inside a data extent
            ((3 << 30) - 4096, rng.bytes(4096)), // the last block
        ],
    );
}

#[test]
fn import_export_round_trip_keeps_bytes_and_holes() {
    let d = tmp();
    let pool = d.path().join("pool");
    let img = d.path().join("disk.img");
    realistic_image(&img, 7);
    ok(&pool, &["init"]);
    let out = ok(&pool, &["import", img.to_str().unwrap_or_default()]);
    assert!(out.contains("imported"), "{out}");
    let back = d.path().join("back.img");
    ok(
        &pool,
        &["export", "disk", back.to_str().unwrap_or_default()],
    );
    assert!(same_bytes(&img, &back), "exported image differs");
    // Holes stay holes: the export allocates no more than the original's data.
    let alloc = |p: &Path| data_extents(p).iter().map(|e| e.1).sum::<u64>();
    assert!(
        alloc(&back) <= alloc(&img),
        "export allocated {} > original {}",
        alloc(&back),
        alloc(&img)
    );
    assert!(
        alloc(&back) <= (66 << 20) + 8192,
        "export allocated {}",
        alloc(&back)
    );
    // Stats: the duplicated 24 MiB is stored once, and physical_bytes agrees with du -sb.
    let s = json(&ok(&pool, &["stats", "--json"]));
    let written = s["written_bytes"].as_u64().unwrap_or(0);
    let physical = s["physical_bytes"].as_u64().unwrap_or(0);
    assert_eq!(written, (65 << 20) + 4096, "non-zero bytes written");
    assert!(
        s["dedup_saving_percent"].as_f64().unwrap_or(0.0) > 40.0,
        "{s}"
    );
    assert!(physical < 30 << 20, "physical {physical}");
    let du = du_sb(&pool);
    assert!(
        physical.abs_diff(du) <= (du / 100).max(1 << 20),
        "stats {physical} vs du -sb {du}"
    );
    for key in [
        "logical_bytes",
        "zero_bytes",
        "unique_chunks",
        "compression_saving_percent",
        "saving_percent",
        "dead_bytes",
        "index_ram_bytes",
    ] {
        assert!(!s[key].is_null(), "missing {key}");
    }
    assert_eq!(s["volumes"][0]["name"], "disk");
    assert_eq!(s["zero_bytes"].as_u64(), Some((8 << 20) + 4096));
    // Overwrite by deleting: dead space appears, gc reclaims it.
    ok(&pool, &["volume", "delete", "disk"]);
    let s = json(&ok(&pool, &["stats", "--json"]));
    assert!(s["dead_bytes"].as_u64().unwrap_or(0) > 20 << 20, "{s}");
    ok(&pool, &["gc"]);
    let s = json(&ok(&pool, &["stats", "--json"]));
    assert_eq!(s["dead_bytes"].as_u64(), Some(0), "{s}");
    assert!(du_sb(&pool) < 1 << 20);
}

#[test]
fn volume_commands_and_resize() {
    let d = tmp();
    let pool = d.path().join("pool");
    ok(&pool, &["init", "--compression", "zstd:5"]);
    ok(&pool, &["volume", "create", "vm1", "--size", "100G"]);
    let l = json(&ok(&pool, &["volume", "list", "--json"]));
    assert_eq!(l[0]["logical_bytes"].as_u64(), Some(100 << 30));
    let img = d.path().join("small.img");
    make_image(&img, 8 << 20, &[(4 << 20, Rng(3).bytes(1 << 20))]);
    ok(
        &pool,
        &[
            "import",
            img.to_str().unwrap_or_default(),
            "--name",
            "small",
        ],
    );
    // Shrinking below data needs --force; growing is free.
    let e = fails(&pool, &["volume", "resize", "small", "4M"]);
    assert!(e.contains("--force"), "{e}");
    ok(&pool, &["volume", "resize", "small", "16M"]);
    ok(&pool, &["volume", "resize", "small", "4M", "--force"]);
    let info = json(&ok(&pool, &["volume", "info", "small", "--json"]));
    assert_eq!(info["logical_bytes"].as_u64(), Some(4 << 20));
    assert_eq!(info["written_bytes"].as_u64(), Some(0));
    ok(&pool, &["volume", "resize", "small", "8M"]);
    let back = d.path().join("back.img");
    ok(
        &pool,
        &["export", "small", back.to_str().unwrap_or_default()],
    );
    assert!(same_bytes(&back, &{
        let z = d.path().join("zeros.img");
        make_image(&z, 8 << 20, &[]);
        z
    }));
}

#[test]
fn bad_input_gets_clear_errors_and_changes_nothing() {
    let d = tmp();
    let pool = d.path().join("pool");
    // Not a pool.
    fs::create_dir_all(d.path().join("empty")).ok();
    let e = fails(&d.path().join("empty"), &["stats"]);
    assert!(e.contains("not a Condense pool"), "{e}");
    ok(&pool, &["init"]);
    ok(&pool, &["volume", "create", "vm1", "--size", "1G"]);
    let before = dir_snapshot(&pool);
    let e = fails(&pool, &["volume", "info", "nosuch"]);
    assert!(e.contains("not found"), "{e}");
    let e = fails(
        &pool,
        &[
            "export",
            "nosuch",
            d.path().join("x").to_str().unwrap_or_default(),
        ],
    );
    assert!(e.contains("not found"), "{e}");
    let e = fails(&pool, &["volume", "create", "vm2", "--size", "5000"]);
    assert!(e.contains("multiple of the pool's block size"), "{e}");
    let e = fails(&pool, &["volume", "create", "vm1", "--size", "1G"]);
    assert!(e.contains("already exists"), "{e}");
    let e = fails(&pool, &["volume", "create", "a/b", "--size", "1G"]);
    assert!(e.contains("invalid volume name"), "{e}");
    let e = fails(&pool, &["volume", "create", "vm3", "--size", "12Q"]);
    assert!(e.contains("unknown size unit"), "{e}");
    let odd = d.path().join("odd.img");
    make_image(&odd, 10_000, &[(0, vec![1; 100])]);
    let e = fails(&pool, &["import", odd.to_str().unwrap_or_default()]);
    assert!(e.contains("not a multiple"), "{e}");
    let e = fails(&pool, &["init"]);
    assert!(e.contains("already holds a Condense pool"), "{e}");
    assert!(
        dir_snapshot(&pool) == before,
        "a failed command changed the pool"
    );

    // Locked by another process.
    {
        use std::os::fd::AsRawFd;
        let f = File::open(pool.join("lock")).unwrap_or_else(|e| panic!("lock file: {e}"));
        // SAFETY: flock on an open descriptor.
        assert_eq!(
            unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) },
            0
        );
        let e = fails(&pool, &["volume", "create", "vm2", "--size", "1G"]);
        assert!(e.contains("in use by another process"), "{e}");
    }
    assert!(dir_snapshot(&pool) == before);

    // A truncated journal: a clear error, and the file is left as it was.
    let journal = fs::read_dir(&pool)
        .ok()
        .and_then(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.path())
                .find(|p| p.to_string_lossy().contains("journal-"))
        })
        .unwrap_or_else(|| panic!("no journal file"));
    let full = fs::read(&journal).unwrap_or_default();
    fs::write(&journal, &full[..10]).unwrap_or_else(|e| panic!("truncate: {e}"));
    let e = fails(&pool, &["volume", "list"]);
    assert!(e.contains("journal") && e.contains("truncated"), "{e}");
    assert_eq!(fs::read(&journal).unwrap_or_default().len(), 10);
    fs::write(&journal, &full).unwrap_or_else(|e| panic!("restore: {e}"));
    ok(&pool, &["volume", "list"]);
}

#[test]
fn corruption_fails_reads_and_verify_names_the_damage() {
    let d = tmp();
    let pool = d.path().join("pool");
    ok(&pool, &["init"]);
    let a = d.path().join("a.img");
    let b = d.path().join("b.img");
    make_image(&a, 16 << 20, &[(0, Rng(11).bytes(4 << 20))]);
    make_image(&b, 16 << 20, &[(0, Rng(12).bytes(4 << 20))]);
    ok(&pool, &["import", a.to_str().unwrap_or_default()]);
    ok(&pool, &["import", b.to_str().unwrap_or_default()]);
    assert!(condense(&pool, &["verify"]).status.success());
    // Flip a byte in the first quarter of the segment: volume a's data (written first).
    let seg = fs::read_dir(&pool)
        .ok()
        .and_then(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.path())
                .find(|p| p.to_string_lossy().contains("seg-"))
        })
        .unwrap_or_else(|| panic!("no segment"));
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&seg)
        .unwrap_or_else(|e| panic!("{e}"));
    let mut byte = [0u8; 1];
    let at = 1 << 20;
    f.read_exact_at(&mut byte, at)
        .unwrap_or_else(|e| panic!("{e}"));
    byte[0] ^= 0x40;
    f.write_all_at(&byte, at).unwrap_or_else(|e| panic!("{e}"));
    drop(f);
    let e = fails(
        &pool,
        &[
            "export",
            "a",
            d.path().join("a.out").to_str().unwrap_or_default(),
        ],
    );
    assert!(e.contains("checksum") && e.contains("volume \"a\""), "{e}");
    let bout = d.path().join("b.out");
    ok(&pool, &["export", "b", bout.to_str().unwrap_or_default()]);
    assert!(same_bytes(&b, &bout), "undamaged volume b must still read");
    let v = condense(&pool, &["verify", "--json"]);
    assert_eq!(v.status.code(), Some(3), "verify must report damage");
    let r = json(&String::from_utf8_lossy(&v.stdout));
    assert_eq!(r["bad_blocks"][0]["volume"], "a", "{r}");
    assert_eq!(r["bad_blocks"].as_array().map(|a| a.len()), Some(1), "{r}");
    assert_eq!(
        r["bad_blocks"][0]["blocks"].as_array().map(|a| a.len()),
        Some(1),
        "{r}"
    );

    // Metadata: damage the root page of volume a's block map in meta.dat.
    let metap = pool.join("meta.dat");
    let mut meta = fs::read(&metap).unwrap_or_default();
    let root = json(&ok(&pool, &["debug-map", "a"]));
    let unit = root["root_unit"].as_u64().unwrap_or(0) as usize;
    assert!(unit >= 64, "{root}");
    meta[unit * 64 + 1] ^= 0x01;
    fs::write(&metap, &meta).unwrap_or_else(|e| panic!("{e}"));
    let v = condense(&pool, &["verify", "--json"]);
    assert_eq!(v.status.code(), Some(3));
    let r = json(&String::from_utf8_lossy(&v.stdout));
    assert_eq!(r["bad_volumes"][0], "a", "{r}");
    assert!(
        !r["metadata_problems"]
            .as_array()
            .is_none_or(|a| a.is_empty()),
        "{r}"
    );
    let e = fails(
        &pool,
        &[
            "export",
            "a",
            d.path().join("a2.out").to_str().unwrap_or_default(),
            "--force",
        ],
    );
    assert!(
        e.contains("checksum") && e.contains("volume \"a\"") && e.contains("metadata page"),
        "{e}"
    );
    let bout2 = d.path().join("b2.out");
    ok(&pool, &["export", "b", bout2.to_str().unwrap_or_default()]);
    assert!(same_bytes(&b, &bout2));
    // Reference counts live in the chunk table, so GC stays safe with a damaged map: it
    // drops nothing a block still names, and b still reads.
    ok(&pool, &["gc"]);
    let bout3 = d.path().join("b3.out");
    ok(&pool, &["export", "b", bout3.to_str().unwrap_or_default()]);
    assert!(same_bytes(&b, &bout3));

    // A damaged checkpoint root: the pool opens with its copy and says so...
    let ckp = pool.join("checkpoint");
    let mut ck = fs::read(&ckp).unwrap_or_default();
    ck[30] ^= 0x80;
    fs::write(&ckp, &ck).unwrap_or_else(|e| panic!("{e}"));
    let out = condense(&pool, &["stats"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("the pool opened with checkpoint.copy"),
        "{err}"
    );
    // ...and both copies damaged: a clear error, no crash.
    fs::write(pool.join("checkpoint.copy"), &ck).unwrap_or_else(|e| panic!("{e}"));
    let e = fails(&pool, &["stats"]);
    assert!(e.contains("checkpoint root"), "{e}");
}

#[test]
fn kill_9_during_import_leaves_a_consistent_pool() {
    let d = tmp();
    let pool = d.path().join("pool");
    ok(&pool, &["init"]);
    let first = d.path().join("first.img");
    make_image(&first, 32 << 20, &[(0, Rng(21).bytes(8 << 20))]);
    ok(&pool, &["import", first.to_str().unwrap_or_default()]);
    let big = d.path().join("big.img");
    make_image(
        &big,
        1 << 30,
        &[
            (0, Rng(22).bytes(160 << 20)),
            (512 << 20, Rng(23).bytes(96 << 20)),
        ],
    );
    let mut rng = Rng(99);
    for round in 0..6 {
        let name = format!("big{round}");
        let mut child = Command::new(BIN)
            .arg("--pool")
            .arg(&pool)
            .args(["import", big.to_str().unwrap_or_default(), "--name", &name])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn: {e}"));
        std::thread::sleep(Duration::from_millis(20 + rng.next() % 600));
        // SIGKILL: no chance to clean up.
        let _ = child.kill();
        let _ = child.wait();
        let v = condense(&pool, &["verify"]);
        assert!(
            v.status.success(),
            "round {round}: verify after kill -9: {}{}",
            String::from_utf8_lossy(&v.stdout),
            String::from_utf8_lossy(&v.stderr)
        );
        let out = d.path().join("first.out");
        ok(
            &pool,
            &[
                "export",
                "first",
                out.to_str().unwrap_or_default(),
                "--force",
            ],
        );
        assert!(
            same_bytes(&first, &out),
            "round {round}: earlier volume damaged"
        );
        // An interrupted import is visible as such and can be deleted.
        let list = ok(&pool, &["volume", "list"]);
        if list.contains(&name) && list.contains("incomplete") {
            ok(&pool, &["volume", "delete", &name]);
        }
    }
}

#[test]
fn full_disk_fails_cleanly_and_keeps_the_pool() {
    let is_root = unsafe { libc::geteuid() } == 0;
    let ci = std::env::var("CI").is_ok_and(|v| v == "true");
    if !is_root {
        assert!(
            !ci,
            "CI must run this test as root (it mounts a small tmpfs)"
        );
        eprintln!("skipping full_disk test: needs root to mount a small tmpfs");
        return;
    }
    let d = tmp();
    let mnt = d.path().join("small");
    fs::create_dir_all(&mnt).ok();
    let st = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=96m", "tmpfs"])
        .arg(&mnt)
        .status();
    assert!(st.is_ok_and(|s| s.success()), "mount tmpfs");
    let result = std::panic::catch_unwind(|| {
        let pool = mnt.join("pool");
        ok(&pool, &["init", "--compression", "none"]);
        let small = d.path().join("small.img");
        make_image(&small, 8 << 20, &[(0, Rng(31).bytes(4 << 20))]);
        ok(&pool, &["import", small.to_str().unwrap_or_default()]);
        let big = d.path().join("big.img");
        make_image(&big, 256 << 20, &[(0, Rng(32).bytes(200 << 20))]);
        let e = fails(&pool, &["import", big.to_str().unwrap_or_default()]);
        assert!(e.contains("no space"), "{e}");
        // The pool opens, verifies clean, and keeps what it had.
        let v = condense(&pool, &["verify"]);
        assert!(v.status.success(), "{}", String::from_utf8_lossy(&v.stdout));
        let list = ok(&pool, &["volume", "list"]);
        assert!(
            !list.contains("big"),
            "the failed import must not leave a volume: {list}"
        );
        let out = d.path().join("small.out");
        ok(
            &pool,
            &["export", "small", out.to_str().unwrap_or_default()],
        );
        assert!(same_bytes(&small, &out));
        ok(&pool, &["gc"]);
    });
    let _ = Command::new("umount").arg(&mnt).status();
    if let Err(p) = result {
        std::panic::resume_unwind(p);
    }
}

#[test]
fn stats_work_while_the_pool_is_served() {
    let d = tmp();
    let pool = d.path().join("pool");
    ok(&pool, &["init"]);
    let img = d.path().join("a.img");
    make_image(&img, 8 << 20, &[(0, Rng(41).bytes(2 << 20))]);
    ok(&pool, &["import", img.to_str().unwrap_or_default()]);
    let sock = d.path().join("nbd.sock");
    let mut server = Command::new(BIN)
        .arg("--pool")
        .arg(&pool)
        .args(["serve", "--socket", sock.to_str().unwrap_or_default()])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn serve: {e}"));
    let mut published = false;
    for _ in 0..50 {
        std::thread::sleep(Duration::from_millis(100));
        if pool.join("status.json").exists() && pool.join("control.sock").exists() {
            published = true;
            break;
        }
    }
    // Live figures through the control socket.
    let live = condense(&pool, &["stats", "--json"]);
    // Without an answering control socket (as with an older serve), the published figures.
    let _ = std::fs::remove_file(pool.join("control.sock"));
    let o = condense(&pool, &["stats", "--json"]);
    let _ = Command::new("kill").arg(server.id().to_string()).status();
    let _ = server.wait();
    assert!(published, "serve did not publish statistics");
    assert!(
        live.status.success(),
        "{}",
        String::from_utf8_lossy(&live.stderr)
    );
    let s = json(&String::from_utf8_lossy(&live.stdout));
    assert_eq!(s["written_bytes"].as_u64(), Some(2 << 20));
    assert!(!String::from_utf8_lossy(&live.stderr).contains("in use by process"));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let s = json(&String::from_utf8_lossy(&o.stdout));
    assert_eq!(s["written_bytes"].as_u64(), Some(2 << 20));
    assert!(String::from_utf8_lossy(&o.stderr).contains("in use by process"));
    assert!(
        !pool.join("status.json").exists(),
        "status file left behind after a clean stop"
    );
}

/// `volume info` walks the map for a volume's exact share: two volumes sharing every chunk
/// pay half each, a volume of its own data pays all of it. (`stats` shares the pool's chunk
/// bytes out by written blocks, which would give all three the same.)
#[test]
fn volume_info_gives_the_exact_physical_share() {
    let d = tmp();
    let pool = d.path().join("pool");
    ok(&pool, &["init"]);
    let shared = d.path().join("shared.img");
    let own = d.path().join("own.img");
    make_image(&shared, 1 << 20, &[(0, Rng(11).bytes(1 << 20))]);
    make_image(&own, 1 << 20, &[(0, Rng(12).bytes(1 << 20))]);
    for (img, name) in [(&shared, "a"), (&shared, "b"), (&own, "c")] {
        ok(
            &pool,
            &["import", img.to_str().unwrap_or_default(), "--name", name],
        );
    }
    // Random data is stored raw: 256 records of a 32-byte header and 4096 bytes.
    let records = 256 * (32 + 4096);
    let share = |name: &str| {
        json(&ok(&pool, &["volume", "info", name, "--json"]))["physical_bytes"]
            .as_u64()
            .unwrap_or_else(|| panic!("no physical_bytes for {name}"))
    };
    assert_eq!(share("a"), records / 2);
    assert_eq!(share("b"), records / 2);
    assert_eq!(share("c"), records);
}

/// `stats` tells what each VM costs: three VMs from one base image, each with data of its
/// own, show different "would free" figures that add up with the shared part to the pool's
/// chunk bytes; deleting one and running gc frees what its figure said.
#[test]
fn stats_say_what_deleting_a_vm_frees() {
    let d = tmp();
    let pool = d.path().join("pool");
    ok(&pool, &["init"]);
    let base = Rng(1).bytes(4 << 20);
    for i in 1..=3u64 {
        let img = d.path().join(format!("vm{i}.img"));
        let own = Rng(10 + i).bytes((i << 20) as usize);
        make_image(&img, 16 << 20, &[(0, base.clone()), (8 << 20, own)]);
        let name = format!("vm{i}");
        ok(
            &pool,
            &["import", img.to_str().unwrap_or_default(), "--name", &name],
        );
    }
    let n =
        |j: &serde_json::Value, k: &str| j[k].as_u64().unwrap_or_else(|| panic!("no {k} in {j}"));
    let vm = |s: &serde_json::Value, name: &str| {
        s["volumes"]
            .as_array()
            .and_then(|a| {
                a.iter()
                    .chain(s["snapshots"].as_array().into_iter().flatten())
                    .find(|v| v["name"] == name)
                    .cloned()
            })
            .unwrap_or_else(|| panic!("no {name} in {s}"))
    };
    // The sum rule: every volume's and snapshot's exclusive part plus the shared part.
    let sums_exact = |s: &serde_json::Value| {
        let exclusive: u64 = s["volumes"]
            .as_array()
            .into_iter()
            .chain(s["snapshots"].as_array())
            .flatten()
            .map(|v| n(v, "exclusive_bytes"))
            .sum();
        assert_eq!(exclusive + n(s, "shared_bytes"), n(s, "chunk_bytes"), "{s}");
    };
    let s = json(&ok(&pool, &["stats", "--json"]));
    for i in 1..=3u64 {
        let v = vm(&s, &format!("vm{i}"));
        // Random data is stored raw: its own blocks are its alone, the base is shared.
        assert_eq!(n(&v, "exclusive_chunks"), i * 256, "{v}");
        assert_eq!(n(&v, "exclusive_bytes"), i * 256 * (4096 + 32), "{v}");
        assert_eq!(n(&v, "shared_chunks"), 1024, "{v}");
        assert_eq!(v["dedup_ratio"].as_f64(), Some(1.0), "{v}");
    }
    assert_eq!(n(&s, "shared_chunks"), 1024);
    sums_exact(&s);
    let text = ok(&pool, &["stats"]);
    assert!(
        text.contains("would free") && text.contains("1.00x"),
        "{text}"
    );

    // A snapshot of vm1 shares all of it; vm1 alone would free nothing now.
    ok(&pool, &["snapshot", "create", "vm1", "s"]);
    let s = json(&ok(&pool, &["stats", "--json"]));
    assert_eq!(n(&vm(&s, "vm1"), "exclusive_bytes"), 0);
    assert_eq!(n(&vm(&s, "vm1@s"), "exclusive_bytes"), 0);
    assert_eq!(n(&vm(&s, "vm1@s"), "shared_chunks"), 1024 + 256);
    sums_exact(&s);

    // Deleting vm3 and running gc frees what its figure said: the live chunk bytes exactly;
    // the segment files by as much, less the dead bytes gc left and up to segment headers.
    let frees = n(&vm(&s, "vm3"), "exclusive_bytes");
    ok(&pool, &["volume", "delete", "vm3"]);
    ok(&pool, &["gc", "--min-dead-percent", "1"]);
    let after = json(&ok(&pool, &["stats", "--json"]));
    assert_eq!(n(&s, "chunk_bytes") - n(&after, "chunk_bytes"), frees);
    let files = |j: &serde_json::Value| n(j, "data_bytes") - n(j, "dead_bytes");
    let freed = files(&s) - files(&after);
    assert!(
        freed.abs_diff(frees) <= 4096 * n(&s, "segments"),
        "freed {freed}, figure {frees}"
    );
    assert!(
        n(&after, "data_bytes") < n(&s, "data_bytes") - frees / 2,
        "{after}"
    );
    // The base is still shared by vm1, its snapshot and vm2.
    assert_eq!(n(&vm(&after, "vm2"), "exclusive_chunks"), 512);
    assert_eq!(n(&after, "shared_chunks"), 1024 + 256);
    sums_exact(&after);
}

//! Pools in an object store (engine::remote), on a directory used as the store (`file://`,
//! the same `ObjectBackend` conformance suite as S3; tests/s3/pool.sh runs the same on a
//! Garage cluster): round trip through the bucket, a disaster reopen from the bucket alone
//! under both durabilities, the lease refusing a second writer, and a read-only reader.
//!
//! The durability is the pool's (issue 23): `connect` used to write its own default
//! (`local`) into the new local directory, so a `remote` pool reconnected after a lost disk
//! stopped uploading its flushes, and the next lost disk lost acknowledged writes. The tests
//! `durability_*` pin that it is stored with the pool, kept by a plain connect, changed only
//! by `set_durability`, and taken once from an older `remote.conf`.

use condense_engine::format::Superblock;
use condense_engine::remote::{self, Durability, RemoteConf};
use condense_engine::{Error, InitOptions, OpenOptions, Pool};
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[allow(dead_code)] // the helpers the multi-host tests use and these do not
#[path = "shared_pool/mod.rs"]
mod shared_pool;
use shared_pool::{block, check, BS, CACHE};

struct Bucket {
    _tmp: tempfile::TempDir,
    root: PathBuf,
}

impl Bucket {
    fn new() -> Bucket {
        let tmp = tempfile::tempdir().expect("tempdir");
        let root = tmp.path().to_path_buf();
        std::fs::create_dir_all(root.join("store")).expect("store dir");
        Bucket { _tmp: tmp, root }
    }
    fn conf(&self, read_only: bool) -> RemoteConf {
        RemoteConf {
            url: format!("file://{}", self.root.join("store").display()),
            endpoint: None,
            region: None,
            credentials: None,
            durability_to_store: None,
            read_only,
        }
    }
    /// A new local directory `name` for the pool, with a plain `connect` (no durability).
    fn connect(&self, name: &str) -> PathBuf {
        let local = self.local(name);
        remote::connect(&local, &self.conf(false), None, CACHE).expect("connect");
        local
    }
    /// The pool's superblock as the bucket's newest root names it, and its object.
    fn superblock_object(&self) -> (String, Superblock) {
        let (obj, bytes) = remote::stored_file(&self.conf(false), "superblock")
            .expect("read the bucket")
            .expect("a superblock");
        (obj, Superblock::decode(&bytes).expect("decode superblock"))
    }
    fn superblock(&self) -> Superblock {
        self.superblock_object().1
    }
    /// Every object: name → (inode, content hash). The directory store puts an object by a
    /// rename, so an object put again has a new inode even with the same bytes.
    fn snapshot(&self) -> std::collections::BTreeMap<String, (u64, blake3::Hash)> {
        use std::os::unix::fs::MetadataExt;
        let base = self.root.join("store");
        self.objects()
            .into_iter()
            .filter_map(|o| {
                let p = base.join(&o);
                let ino = std::fs::metadata(&p).ok()?.ino();
                let bytes = std::fs::read(&p).ok()?;
                Some((o, (ino, blake3::hash(&bytes))))
            })
            .collect()
    }
    /// Every object in the bucket (names relative to the store directory).
    fn objects(&self) -> Vec<String> {
        fn walk(dir: &Path, base: &Path, out: &mut Vec<String>) {
            for e in std::fs::read_dir(dir).expect("read store").flatten() {
                let p = e.path();
                if p.is_dir() {
                    walk(&p, base, out);
                } else if let Ok(rel) = p.strip_prefix(base) {
                    out.push(rel.display().to_string());
                }
            }
        }
        let mut out = Vec::new();
        let base = self.root.join("store");
        walk(&base, &base, &mut out);
        out.sort();
        out
    }
    fn local(&self, name: &str) -> PathBuf {
        self.root.join(name)
    }
    /// What a host that died leaves: its lease claim, until it expires. Tests in one process
    /// cannot wait 30 s, so they remove the claims as the expiry would.
    fn expire_lease(&self) {
        let _ = std::fs::remove_dir_all(self.root.join("store").join("claims"));
    }
}

/// No background thread: the tests decide when segments are uploaded and checkpoints run.
fn open(path: &Path) -> condense_engine::Result<Arc<Pool>> {
    Pool::open_path(
        path,
        OpenOptions {
            destage_in_background: false,
            ..Default::default()
        },
    )
}

fn write(pool: &Pool, vol: &str, first_tag: u64, blocks: u64) {
    let h = pool.volume(vol).expect("volume");
    let data: Vec<u8> = (0..blocks).flat_map(|b| block(first_tag + b)).collect();
    h.write_at(0, &data, false).expect("write");
}

fn new_pool(bucket: &Bucket, durability: Durability) -> PathBuf {
    let local = bucket.local("host1");
    Pool::init_remote(
        &local,
        &bucket.conf(false),
        durability,
        CACHE,
        &InitOptions {
            segment_bytes_target: 1 << 20,
            ..Default::default()
        },
    )
    .expect("init");
    local
}

#[test]
fn a_pool_round_trips_through_the_bucket_and_a_new_host_reads_it() {
    let bucket = Bucket::new();
    let local = new_pool(&bucket, Durability::Local);
    let pool = open(&local).expect("open");
    pool.create_volume("a", 2048 * BS as u64).expect("create");
    write(&pool, "a", 1, 2048);
    pool.close().expect("close");
    drop(pool);
    let segments = bucket
        .objects()
        .iter()
        .filter(|o| o.rsplit('/').next().is_some_and(|n| n.starts_with("seg-")))
        .count();
    assert!(
        segments >= 2,
        "8 MiB in 1 MiB segments: {segments} uploaded"
    );
    assert!(
        !std::fs::read_dir(&local)
            .expect("local")
            .any(|e| e.is_ok_and(|e| e.file_name().to_string_lossy().starts_with("seg-"))),
        "a clean close leaves no segment only in the local directory"
    );
    // The lease is released at a clean close: another host opens at once.
    let host2 = bucket.connect("host2");
    let pool = open(&host2).expect("open on host 2");
    check(&pool, "a", 1, 2048);
    let s = pool.stats().expect("stats");
    let r = s.remote.expect("remote stats");
    assert!(r.objects as usize > segments, "{r:?}");
    assert_eq!(r.durability, Durability::Local);
}

/// A host writes tags 1.. and closes (everything uploaded), writes tags 1000.., flushes and
/// is lost with its disk; a second host connects to the bucket alone and opens the pool.
fn lose_a_host_after_a_flush(bucket: &Bucket, durability: Durability) -> Arc<Pool> {
    let local = new_pool(bucket, durability);
    let pool = open(&local).expect("open");
    pool.create_volume("a", 512 * BS as u64).expect("create");
    write(&pool, "a", 1, 512);
    pool.close().expect("close");
    drop(pool);
    let pool = open(&local).expect("reopen");
    write(&pool, "a", 1000, 512);
    pool.flush().expect("flush");
    drop(pool);
    std::fs::remove_dir_all(&local).expect("lose the host");
    bucket.expire_lease();
    let host2 = bucket.connect("host2");
    let pool = open(&host2).expect("disaster reopen");
    let report = pool.verify(&|_, _| ()).expect("verify");
    assert!(report.bad_chunks.is_empty(), "{:?}", report.bad_chunks);
    pool
}

#[test]
fn disaster_with_local_durability_keeps_everything_up_to_the_last_upload() {
    let bucket = Bucket::new();
    // The flushed writes were only in the lost local journal.
    check(
        &lose_a_host_after_a_flush(&bucket, Durability::Local),
        "a",
        1,
        512,
    );
}

#[test]
fn disaster_with_remote_durability_keeps_every_flushed_write() {
    let bucket = Bucket::new();
    let pool = lose_a_host_after_a_flush(&bucket, Durability::Remote);
    check(&pool, "a", 1000, 512);
    // And it stays: the rebuilt host closes cleanly and a third host reads the same.
    pool.close().expect("close");
    drop(pool);
    let host3 = bucket.connect("host3");
    check(&open(&host3).expect("open host 3"), "a", 1000, 512);
}

#[test]
fn the_lease_refuses_a_second_writer_and_a_reader_opens_beside_it() {
    let bucket = Bucket::new();
    let local = new_pool(&bucket, Durability::Local);
    let pool = open(&local).expect("open");
    pool.create_volume("a", 64 * BS as u64).expect("create");
    write(&pool, "a", 7, 64);
    pool.close().expect("checkpoint");
    let host2 = bucket.connect("host2");
    match open(&host2) {
        Err(Error::Busy(m)) => assert!(m.contains("held by"), "{m}"),
        Err(e) => panic!("second writer: unexpected error {e}"),
        Ok(_) => panic!("a second writer opened the pool"),
    }
    let reader = bucket.local("reader");
    remote::connect(&reader, &bucket.conf(true), None, CACHE).expect("connect");
    let r = open(&reader).expect("reader opens beside the writer");
    assert!(r.is_read_only());
    check(&r, "a", 7, 64);
    assert!(r
        .volume("a")
        .and_then(|h| h.write_at(0, &block(1), false))
        .is_err());
    // The writer goes on writing while the reader is open.
    write(&pool, "a", 100, 64);
    pool.close().expect("close");
    drop(pool);
    // Released: host 2 opens now, and writes.
    let pool2 = open(&host2).expect("host 2 after the writer stopped");
    check(&pool2, "a", 100, 64);
    write(&pool2, "a", 200, 64);
    pool2.close().expect("close host 2");
    drop(pool2);
    // Host 1's metadata mirror is stale now: its next open fetches the bucket's.
    check(&open(&local).expect("host 1 again"), "a", 200, 64);
}

#[test]
fn gc_reclaims_objects_and_another_host_reads_what_it_moved() {
    let bucket = Bucket::new();
    let local = new_pool(&bucket, Durability::Local);
    let pool = open(&local).expect("open");
    pool.create_volume("a", 1024 * BS as u64).expect("create");
    pool.create_volume("b", 1024 * BS as u64).expect("create");
    write(&pool, "a", 1, 1024);
    write(&pool, "b", 5000, 1024);
    pool.close().expect("upload");
    // Overwriting "a" leaves its first segments mostly dead; "b" keeps live chunks among them.
    write(&pool, "a", 9000, 1024);
    pool.close().expect("upload");
    let before = pool.stats().expect("stats").remote.expect("remote").bytes;
    let report = pool.gc(30).expect("gc");
    assert!(report.segments_removed > 0, "{report:?}");
    pool.close().expect("upload");
    let after = pool.stats().expect("stats").remote.expect("remote").bytes;
    assert!(
        after < before,
        "the bucket holds {after} bytes after GC, {before} before"
    );
    drop(pool);
    let host2 = bucket.connect("host2");
    let pool = open(&host2).expect("open on host 2");
    check(&pool, "a", 9000, 1024);
    check(&pool, "b", 5000, 1024);
    assert!(pool.verify(&|_, _| ()).expect("verify").is_clean());
}

/// Write tags `first..first+blocks` at block `at` of volume "a", flush, and lose the host:
/// its process ends without a close (nothing more is uploaded), its local directory is gone.
fn write_flush_and_lose(bucket: &Bucket, local: &Path, at: u64, first: u64, blocks: u64) {
    let pool = open(local).expect("open");
    let h = pool.volume("a").expect("volume");
    let data: Vec<u8> = (0..blocks).flat_map(|b| block(first + b)).collect();
    h.write_at(at * BS as u64, &data, false).expect("write");
    pool.flush().expect("flush");
    drop(h);
    drop(pool);
    std::fs::remove_dir_all(local).expect("lose the local directory");
    bucket.expire_lease();
}

fn check_at(pool: &Pool, at: u64, first: u64, blocks: u64) {
    let h = pool.volume("a").expect("volume");
    let mut buf = vec![0u8; blocks as usize * BS];
    h.read_at(at * BS as u64, &mut buf).expect("read");
    for b in 0..blocks as usize {
        assert!(
            buf[b * BS..(b + 1) * BS] == block(first + b as u64)[..],
            "block {} differs",
            at as usize + b
        );
    }
}

#[test]
fn durability_remote_survives_two_lost_local_directories_with_plain_connects() {
    let bucket = Bucket::new();
    let local = new_pool(&bucket, Durability::Remote);
    assert_eq!(bucket.superblock().durability, Some(Durability::Remote));
    let pool = open(&local).expect("open");
    pool.create_volume("a", 1024 * BS as u64).expect("create");
    pool.close().expect("close");
    drop(pool);
    write_flush_and_lose(&bucket, &local, 0, 1, 256);
    let host2 = bucket.connect("host2");
    assert!(
        !std::fs::read_to_string(host2.join("remote.conf"))
            .expect("remote.conf")
            .contains("durability"),
        "the host keeps no durability of its own"
    );
    write_flush_and_lose(&bucket, &host2, 256, 5000, 256);
    let host3 = bucket.connect("host3");
    let pool = open(&host3).expect("open after the second loss");
    assert_eq!(pool.durability(), Some(Durability::Remote));
    let r = pool.stats().expect("stats").remote.expect("remote stats");
    assert_eq!(r.durability, Durability::Remote);
    check_at(&pool, 0, 1, 256);
    check_at(&pool, 256, 5000, 256);
    assert!(pool.verify(&|_, _| ()).expect("verify").is_clean());
}

#[test]
fn durability_connect_with_another_one_is_refused_and_the_same_one_accepted() {
    let bucket = Bucket::new();
    new_pool(&bucket, Durability::Remote);
    let host2 = bucket.local("host2");
    match remote::connect(&host2, &bucket.conf(false), Some(Durability::Local), CACHE) {
        Err(Error::Invalid(m)) => {
            assert!(m.contains("durability remote"), "{m}");
            assert!(m.contains("durability set local"), "{m}");
        }
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("connect --durability local accepted on a remote pool"),
    }
    assert!(
        !host2.exists(),
        "a refused connect leaves no local directory"
    );
    let stored = remote::connect(&host2, &bucket.conf(false), Some(Durability::Remote), CACHE)
        .expect("connect --durability remote");
    assert_eq!(stored, Some(Durability::Remote));
}

#[test]
fn durability_set_is_stored_applies_at_once_and_is_kept_across_a_reconnect() {
    let bucket = Bucket::new();
    let local = new_pool(&bucket, Durability::Local);
    let pool = open(&local).expect("open");
    pool.create_volume("a", 1024 * BS as u64).expect("create");
    // Written under local durability, before the change: the change uploads it.
    write(&pool, "a", 1, 128);
    assert_eq!(
        pool.set_durability(Durability::Remote).expect("set remote"),
        Durability::Local
    );
    assert_eq!(bucket.superblock().durability, Some(Durability::Remote));
    assert_eq!(pool.durability(), Some(Durability::Remote));
    assert_eq!(
        pool.set_durability(Durability::Remote).expect("again"),
        Durability::Remote,
        "setting the same durability changes nothing"
    );
    // In effect at once: this open's flushes reach the bucket from now on, so a lost
    // directory loses none of them.
    let h = pool.volume("a").expect("volume");
    let data: Vec<u8> = (0..128).flat_map(|b| block(7000 + b)).collect();
    h.write_at(512 * BS as u64, &data, false).expect("write");
    pool.flush().expect("flush");
    drop(h);
    drop(pool);
    std::fs::remove_dir_all(&local).expect("lose the local directory");
    bucket.expire_lease();
    let host2 = bucket.connect("host2");
    let pool = open(&host2).expect("open host 2");
    assert_eq!(pool.durability(), Some(Durability::Remote));
    check_at(&pool, 0, 1, 128);
    check_at(&pool, 512, 7000, 128);
    // And back: stored for the next host too.
    pool.set_durability(Durability::Local).expect("set local");
    pool.close().expect("close");
    drop(pool);
    let host3 = bucket.connect("host3");
    let pool = open(&host3).expect("open host 3");
    assert_eq!(pool.durability(), Some(Durability::Local));
    check_at(&pool, 512, 7000, 128);
}

#[test]
fn durability_set_is_refused_for_a_local_pool_and_a_reader() {
    let dir = tempfile::tempdir().expect("tempdir");
    Pool::init_path(dir.path(), &InitOptions::default()).expect("init");
    let pool = Pool::open_path(dir.path(), OpenOptions::default()).expect("open");
    assert_eq!(pool.durability(), None);
    assert!(matches!(
        pool.set_durability(Durability::Remote),
        Err(Error::Invalid(m)) if m.contains("not in an object store")
    ));
    let bucket = Bucket::new();
    new_pool(&bucket, Durability::Local);
    let reader = bucket.local("reader");
    remote::connect(&reader, &bucket.conf(true), None, CACHE).expect("connect");
    let r = open(&reader).expect("reader");
    assert!(matches!(
        r.set_durability(Durability::Remote),
        Err(Error::ReadOnly)
    ));
    assert_eq!(bucket.superblock().durability, Some(Durability::Local));
}

/// A pool made before issue 23: no durability in its superblock, `durability=` in the
/// host's `remote.conf`.
fn make_it_old(bucket: &Bucket, local: &Path, conf_durability: Option<Durability>) {
    // Written over its object in place, as only an older Condense's superblock would be.
    let (obj, sb) = bucket.superblock_object();
    let path = bucket.root.join("store").join(obj);
    let sb = Superblock {
        durability: None,
        ..sb
    };
    std::fs::write(&path, sb.encode()).expect("old superblock");
    let conf = RemoteConf {
        durability_to_store: conf_durability,
        ..bucket.conf(false)
    };
    std::fs::write(local.join("remote.conf"), conf.encode()).expect("old remote.conf");
}

#[test]
fn durability_of_an_older_pool_is_taken_once_from_remote_conf() {
    let bucket = Bucket::new();
    let local = new_pool(&bucket, Durability::Local);
    make_it_old(&bucket, &local, Some(Durability::Remote));
    // A read-only open uses it and writes nothing.
    let pool = Pool::open_path(
        &local,
        OpenOptions {
            read_only: true,
            destage_in_background: false,
            ..Default::default()
        },
    )
    .expect("read-only open");
    assert_eq!(pool.durability(), Some(Durability::Remote));
    drop(pool);
    assert_eq!(bucket.superblock().durability, None);
    // The first writable open stores it and drops it from remote.conf.
    let pool = open(&local).expect("open");
    assert_eq!(pool.durability(), Some(Durability::Remote));
    drop(pool);
    assert_eq!(bucket.superblock().durability, Some(Durability::Remote));
    let conf = std::fs::read_to_string(local.join("remote.conf")).expect("remote.conf");
    assert!(!conf.contains("durability"), "{conf}");
}

#[test]
fn durability_stored_in_the_pool_wins_over_an_older_remote_conf() {
    let bucket = Bucket::new();
    let local = new_pool(&bucket, Durability::Remote);
    let conf = RemoteConf {
        durability_to_store: Some(Durability::Local),
        ..bucket.conf(false)
    };
    std::fs::write(local.join("remote.conf"), conf.encode()).expect("old remote.conf");
    let pool = open(&local).expect("open");
    assert_eq!(pool.durability(), Some(Durability::Remote));
    drop(pool);
    assert_eq!(bucket.superblock().durability, Some(Durability::Remote));
    let conf = std::fs::read_to_string(local.join("remote.conf")).expect("remote.conf");
    assert!(!conf.contains("durability"), "{conf}");
}

#[test]
fn durability_of_an_older_pool_without_one_anywhere_is_local_and_stored() {
    let bucket = Bucket::new();
    let local = new_pool(&bucket, Durability::Remote);
    make_it_old(&bucket, &local, None);
    assert_eq!(
        open(&local).expect("open").durability(),
        Some(Durability::Local)
    );
    assert_eq!(bucket.superblock().durability, Some(Durability::Local));
}

/// An S3 configuration whose secrets must not leak: credentials in `creds` (if given).
fn s3_conf(endpoint: Option<&str>, creds: Option<&Path>) -> RemoteConf {
    RemoteConf {
        url: "s3://bucket/prefix".into(),
        endpoint: endpoint.map(str::to_string),
        region: Some("garage".into()),
        credentials: creds.map(Path::to_path_buf),
        durability_to_store: None,
        read_only: false,
    }
}

#[test]
fn credentials_files_readable_by_others_are_refused_with_the_fix() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let creds = dir.path().join("credentials.env");
    std::fs::write(
        &creds,
        "export AWS_ACCESS_KEY_ID=GK1\nexport AWS_SECRET_ACCESS_KEY=topsecret\n",
    )
    .expect("write");
    std::fs::set_permissions(&creds, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let e = match condense_engine::remote::backend(
        &s3_conf(Some("http://127.0.0.1:9"), Some(&creds)),
        false,
    ) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a credentials file of mode 0644 was read"),
    };
    assert!(e.contains("chmod 600"), "{e}");
    assert!(!e.contains("topsecret"), "{e}");
}

#[test]
fn an_endpoint_with_a_password_is_refused_without_showing_it() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let creds = dir.path().join("credentials.env");
    std::fs::write(&creds, "AWS_ACCESS_KEY_ID=GK1\nAWS_SECRET_ACCESS_KEY=x\n").expect("write");
    std::fs::set_permissions(&creds, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    for endpoint in [
        "http://admin:hunter2@127.0.0.1:3900",
        "https://admin:hun@ter2@s3.example.net/",
        "admin:hunter2@s3.example.net",
    ] {
        let e =
            match condense_engine::remote::backend(&s3_conf(Some(endpoint), Some(&creds)), false) {
                Err(e) => e.to_string(),
                Ok(_) => panic!("endpoint {endpoint} accepted"),
            };
        assert!(!e.contains("hunter2") && !e.contains("ter2"), "{e}");
        assert!(e.contains("***@") && e.contains("--credentials"), "{e}");
        assert!(remote::check_endpoint(endpoint).is_err());
    }
    assert!(remote::check_endpoint("http://127.0.0.1:3900").is_ok());
    for endpoint in [
        "https://s3.example.net/?X-Amz-Credential=AK&password=hunter2",
        "https://admin:pw@s3.example.net?x=hunter2",
        "http://127.0.0.1:3900#hunter2",
    ] {
        let e =
            match condense_engine::remote::backend(&s3_conf(Some(endpoint), Some(&creds)), false) {
                Err(e) => e.to_string(),
                Ok(_) => panic!("endpoint {endpoint} accepted"),
            };
        assert!(
            !e.contains("hunter2") && !e.contains("pw@") && e.contains("?***"),
            "{e}"
        );
    }
    let e = remote::parse_s3_url("s3://bucket/p?secret=hunter2")
        .expect_err("a query in the pool URL")
        .to_string();
    assert!(
        !e.contains("hunter2") && e.contains("s3://bucket/p?***"),
        "{e}"
    );
    let e = remote::parse_s3_url("s3://key:hunter2@bucket/p")
        .expect_err("credentials in the pool URL")
        .to_string();
    assert!(
        !e.contains("hunter2") && e.contains("s3://***@bucket/p"),
        "{e}"
    );
}

/// A damaged `meta.dat` mirror in the local directory: every page that fails its check is read
/// again from the bucket's extent objects and the mirror mended, so nothing is lost (the bucket
/// is the other copy).
#[test]
fn a_damaged_metadata_mirror_is_read_again_from_the_bucket_and_mended() {
    let bucket = Bucket::new();
    let local = new_pool(&bucket, Durability::Local);
    let pool = open(&local).expect("open");
    pool.create_volume("a", 512 * BS as u64).expect("create");
    write(&pool, "a", 7, 512);
    pool.close().expect("close");
    drop(pool);
    let mirror = local.join("pool").join("meta.dat");
    let good = std::fs::read(&mirror).expect("mirror");
    let mut bad = good.clone();
    // Every metadata page after the header: zeroed.
    bad[4096..].fill(0);
    std::fs::write(&mirror, &bad).expect("damage the mirror");
    let pool = open(&local).expect("open with a damaged mirror");
    check(&pool, "a", 7, 512);
    assert!(pool.verify(&|_, _| {}).expect("verify").is_clean());
    pool.close().expect("close");
    drop(pool);
    let mended = std::fs::read(&mirror).expect("mirror");
    assert_eq!(
        mended[4096..good.len()],
        good[4096..],
        "the mirror is mended"
    );
}

/// Two hosts open one pool writable at the same moment, round after round: exactly one wins
/// each round (the other is told who holds the pool), the winner writes and closes, and no
/// object of the bucket is ever replaced: every object present before and after a round has
/// the same inode and bytes (claims, roots, manifests, extents: each upload a new object).
#[test]
fn two_hosts_racing_for_one_pool_exactly_one_wins_each_round_and_no_object_is_replaced() {
    let bucket = Bucket::new();
    let local = new_pool(&bucket, Durability::Local);
    let pool = open(&local).expect("open");
    pool.create_volume("a", 64 * BS as u64).expect("create");
    write(&pool, "a", 1, 64);
    pool.close().expect("close");
    drop(pool);
    let hosts = [bucket.connect("h1"), bucket.connect("h2")];
    let mut wins = [0; 2];
    for round in 0..8u64 {
        let before = bucket.snapshot();
        let barrier = std::sync::Barrier::new(2);
        let won: Vec<bool> = std::thread::scope(|s| {
            let runs: Vec<_> = hosts
                .iter()
                .map(|h| {
                    let barrier = &barrier;
                    s.spawn(move || {
                        barrier.wait();
                        match open(h) {
                            Ok(pool) => {
                                write(&pool, "a", 1000 * (round + 1), 64);
                                pool.close().expect("close");
                                true
                            }
                            Err(Error::Busy(m)) => {
                                assert!(m.contains("held by"), "{m}");
                                false
                            }
                            Err(e) => panic!("round {round}: unexpected error {e}"),
                        }
                    })
                })
                .collect();
            runs.into_iter()
                .map(|r| r.join().expect("host thread"))
                .collect()
        });
        assert_eq!(
            won.iter().filter(|w| **w).count(),
            1,
            "round {round}: winners {won:?}"
        );
        for (i, w) in won.iter().enumerate() {
            wins[i] += usize::from(*w);
        }
        let after = bucket.snapshot();
        for (name, v) in &before {
            if let Some(a) = after.get(name) {
                assert_eq!(a, v, "round {round}: object {name} was replaced");
            }
        }
        let reader = open(&hosts[0]).expect("open after the round");
        check(&reader, "a", 1000 * (round + 1), 64);
        reader.close().expect("close");
    }
    eprintln!("wins per host: {wins:?}");
}

/// A pool made before generations (objects named as its files, at the top of the prefix)
/// opens as it is; its first writable open puts a root of its own generation, the next
/// removes the old root, and every later open reads the data of both.
#[test]
fn a_pool_made_before_generations_opens_and_moves_under_a_generation() {
    let bucket = Bucket::new();
    let local = new_pool(&bucket, Durability::Local);
    let pool = open(&local).expect("open");
    pool.create_volume("a", 256 * BS as u64).expect("create");
    write(&pool, "a", 1, 256);
    pool.close().expect("close");
    drop(pool);
    // Lay the bucket out as an older Condense did.
    let store = bucket.root.join("store");
    let files = remote::stored_files(&bucket.conf(false)).expect("view");
    assert!(files.contains_key("checkpoint") && files.contains_key("superblock"));
    for (name, (obj, _)) in &files {
        let to = store.join(name);
        std::fs::create_dir_all(to.parent().expect("parent")).expect("mkdir");
        std::fs::copy(store.join(obj), &to).expect("copy to the old name");
    }
    std::fs::remove_dir_all(store.join("gen")).expect("remove generations");
    std::fs::remove_dir_all(store.join("claims")).expect("remove claims");
    assert!(bucket.objects().iter().all(|o| !o.starts_with("gen/")));
    let host2 = bucket.connect("host2");
    let pool = open(&host2).expect("open the old pool");
    check(&pool, "a", 1, 256);
    write(&pool, "a", 500, 128);
    pool.close().expect("close");
    drop(pool);
    let objects = bucket.objects();
    assert!(
        !objects.contains(&"checkpoint".to_string()),
        "the old root is removed once two roots of the new generation are in: {objects:?}"
    );
    assert!(objects
        .iter()
        .any(|o| o.starts_with("gen/") && o.contains("/checkpoint.")));
    let pool = open(&bucket.connect("host3")).expect("open on host 3");
    check_at(&pool, 0, 500, 128);
    check_at(&pool, 128, 129, 128);
    assert!(pool.verify(&|_, _| ()).expect("verify").is_clean());
}

/// Incompressible content for each tag (xorshift64*), so the segments hold the full bytes.
fn noise_block(tag: u64) -> Vec<u8> {
    let mut s = tag.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..BS / 8)
        .flat_map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            s.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes()
        })
        .collect()
}

/// A pool in `bucket` whose segments are 64 MiB (one per test's data), opened on host 1.
fn pool_of_big_segments(bucket: &Bucket) -> Arc<Pool> {
    let local = bucket.local("host1");
    Pool::init_remote(
        &local,
        &bucket.conf(false),
        Durability::Local,
        CACHE,
        &InitOptions {
            segment_bytes_target: 64 << 20,
            ..Default::default()
        },
    )
    .expect("init");
    open(&local).expect("open")
}

/// The requests `pool`'s store answered so far.
fn store_requests(pool: &Pool) -> condense_object_store::BackendStats {
    pool.stats()
        .expect("stats")
        .remote
        .expect("remote stats")
        .requests
}

/// A cold sequential read on a new host is read ahead: after the first 256 KiB the store has
/// answered GETs the reader never made (blocks ahead of it), the whole read fetches no byte
/// twice, in GETs of about 4 MiB, every byte reads back as written, and so do reads out of
/// order afterwards.
#[test]
fn a_cold_sequential_read_is_read_ahead_and_reads_every_byte() {
    const BLOCKS: u64 = 24 * 256; // 24 MiB of incompressible blocks: one segment
    let bucket = Bucket::new();
    let pool = pool_of_big_segments(&bucket);
    pool.create_volume("n", BLOCKS * BS as u64).expect("create");
    let h = pool.volume("n").expect("volume");
    let data: Vec<u8> = (0..BLOCKS).flat_map(noise_block).collect();
    h.write_at(0, &data, false).expect("write");
    drop(h);
    pool.close().expect("close");
    drop(pool);

    let host2 = bucket.connect("host2");
    let pool = open(&host2).expect("open on host 2");
    let gets = || store_requests(&pool).get_requests;
    let get_bytes = || store_requests(&pool).get_bytes;
    let h = pool.volume("n").expect("volume");
    let before = gets();
    let bytes_before = get_bytes();
    let mut buf = vec![0u8; 256 << 10];
    h.read_at(0, &mut buf).expect("first read");
    assert!(buf[..] == data[..buf.len()], "the first 256 KiB differ");
    // The reader's own GETs for it: its first block alone, then 4 MiB from the next one on.
    // A third GET is the read-ahead's, of blocks past those.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while gets() - before < 3 {
        assert!(
            std::time::Instant::now() < deadline,
            "no read-ahead GET after the first 256 KiB ({} GETs)",
            gets() - before
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    for (i, piece) in data.chunks(buf.len()).enumerate().skip(1) {
        h.read_at((i * buf.len()) as u64, &mut buf)
            .expect("sequential read");
        assert!(
            buf[..] == piece[..],
            "piece {i} of the sequential read differs"
        );
    }
    let sequential = gets() - before;
    let fetched = get_bytes() - bytes_before;
    // ~24.2 MiB of records (4 KiB and a header each): no byte fetched twice...
    let records = data.len() as u64 * 102 / 100;
    assert!(
        fetched <= records,
        "a cold sequential read of 24 MiB fetched {fetched} bytes: blocks fetched twice"
    );
    // ...in GETs of up to 4 MiB: one 256 KiB GET, then 4 MiB ones (7), and the pieces where
    // the read-ahead of the next blocks and of the block map's records meet.
    assert!(
        sequential <= 10,
        "a cold sequential read of 24 MiB took {sequential} GETs"
    );
    // Out of order: from the end backwards, block by block.
    let mut block = vec![0u8; BS];
    for b in (0..BLOCKS).rev().step_by(97) {
        h.read_at(b * BS as u64, &mut block).expect("random read");
        assert!(
            block == noise_block(b),
            "block {b} read out of order differs"
        );
    }
}

/// A cold sequential read of a volume whose blocks are deduplicated against another volume,
/// in another order, is read ahead through its block map: after its first two reads (the
/// second continues the first, so the volume's next 16 MiB are looked up and their records
/// hinted to the bucket), every record the rest of the read needs is fetched in the
/// background, and the rest of the read makes no GET of its own. Without the block map's
/// read-ahead, each scattered 256 KiB block of the other volume's segment is a GET the
/// reader waits for.
#[test]
fn a_cold_read_of_deduplicated_blocks_is_read_ahead_through_the_block_map() {
    const BLOCKS: u64 = 16 * 256; // 16 MiB: one segment of the first volume, one window
    const PIECE: usize = 256 << 10;
    let bucket = Bucket::new();
    let pool = pool_of_big_segments(&bucket);
    let size = BLOCKS * BS as u64;
    pool.create_volume("a", size).expect("create a");
    pool.create_volume("b", size).expect("create b");
    let a: Vec<u8> = (0..BLOCKS).flat_map(noise_block).collect();
    pool.volume("a")
        .expect("a")
        .write_at(0, &a, false)
        .expect("write a");
    // b holds a's blocks in reverse order: every block of b is deduplicated against a
    // record of a's segment, and a sequential read of b reads that segment backwards, which
    // the bucket's own read-ahead (of the blocks after the last one read) never sees.
    let b: Vec<u8> = (0..BLOCKS).rev().flat_map(noise_block).collect();
    pool.volume("b")
        .expect("b")
        .write_at(0, &b, false)
        .expect("write b");
    assert_eq!(pool.stats().expect("stats").unique_chunks, BLOCKS);
    pool.close().expect("close");
    drop(pool);

    let host2 = bucket.connect("host2");
    let pool = open(&host2).expect("open on host 2");
    let gets = || store_requests(&pool).get_requests;
    let h = pool.volume("b").expect("volume b");
    let mut buf = vec![0u8; PIECE];
    for i in 0..2 {
        h.read_at((i * PIECE) as u64, &mut buf).expect("read");
        assert!(
            buf[..] == b[i * PIECE..(i + 1) * PIECE],
            "piece {i} differs"
        );
    }
    // The background GETs end: the count holds still for a second.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut last = gets();
    loop {
        std::thread::sleep(std::time::Duration::from_secs(1));
        let now = gets();
        if now == last {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the read-ahead never settled"
        );
        last = now;
    }
    for (i, piece) in b.chunks(PIECE).enumerate().skip(2) {
        h.read_at((i * PIECE) as u64, &mut buf).expect("read");
        assert!(buf[..] == piece[..], "piece {i} differs");
    }
    let own = gets() - last;
    assert_eq!(
        own, 0,
        "the rest of the read made {own} GETs of its own: its records were not read ahead"
    );
}

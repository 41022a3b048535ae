//! Pools in an object store (engine::remote), on a directory used as the store (`file://`,
//! the same `ObjectBackend` conformance suite as S3; tests/s3/pool.sh runs the same on a
//! Garage cluster): round trip through the bucket, a disaster reopen from the bucket alone
//! under both durabilities, the lease refusing a second writer, and a read-only reader.

use condense_engine::remote::{self, Durability, RemoteConf};
use condense_engine::{Error, InitOptions, OpenOptions, Pool};
use std::path::{Path, PathBuf};
use std::sync::Arc;

const BS: usize = 4096;
const CACHE: u64 = 1 << 30;

/// Distinct, compressible content for each tag.
fn block(tag: u64) -> Vec<u8> {
    let mut b: Vec<u8> = (0..BS)
        .map(|i| ((i / 16) as u64).wrapping_mul(tag | 1) as u8)
        .collect();
    b[..8].copy_from_slice(&tag.to_le_bytes());
    b
}

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
    fn conf(&self, durability: Durability, read_only: bool) -> RemoteConf {
        RemoteConf {
            url: format!("file://{}", self.root.join("store").display()),
            endpoint: None,
            region: None,
            credentials: None,
            durability,
            read_only,
        }
    }
    fn local(&self, name: &str) -> PathBuf {
        self.root.join(name)
    }
    /// What a host that died leaves: its lease, until it expires. Tests in one process
    /// cannot wait 30 s, so they remove it as the expiry would.
    fn expire_lease(&self) {
        let _ = std::fs::remove_file(self.root.join("store").join("lease"));
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

fn check(pool: &Pool, vol: &str, first_tag: u64, blocks: u64) {
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

fn new_pool(bucket: &Bucket, durability: Durability) -> PathBuf {
    let local = bucket.local("host1");
    remote::init(
        &local,
        &bucket.conf(durability, false),
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
    let store = bucket.root.join("store");
    let segments = std::fs::read_dir(&store)
        .expect("store")
        .filter(|e| {
            e.as_ref()
                .is_ok_and(|e| e.file_name().to_string_lossy().starts_with("seg-"))
        })
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
    let host2 = bucket.local("host2");
    remote::connect(&host2, &bucket.conf(Durability::Local, false), CACHE).expect("connect");
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
    let host2 = bucket.local("host2");
    remote::connect(&host2, &bucket.conf(durability, false), CACHE).expect("connect");
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
    let host3 = bucket.local("host3");
    remote::connect(&host3, &bucket.conf(Durability::Local, false), CACHE).expect("connect");
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
    let host2 = bucket.local("host2");
    remote::connect(&host2, &bucket.conf(Durability::Local, false), CACHE).expect("connect");
    match open(&host2) {
        Err(Error::Busy(m)) => assert!(m.contains("held by"), "{m}"),
        Err(e) => panic!("second writer: unexpected error {e}"),
        Ok(_) => panic!("a second writer opened the pool"),
    }
    let reader = bucket.local("reader");
    remote::connect(&reader, &bucket.conf(Durability::Local, true), CACHE).expect("connect");
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
    let host2 = bucket.local("host2");
    remote::connect(&host2, &bucket.conf(Durability::Local, false), CACHE).expect("connect");
    let pool = open(&host2).expect("open on host 2");
    check(&pool, "a", 9000, 1024);
    check(&pool, "b", 5000, 1024);
    assert!(pool.verify(&|_, _| ()).expect("verify").is_clean());
}

//! Large write batches go to the open segment with direct I/O, small ones through the page
//! cache, all written by the segment writer thread while writers go on (engine::segment).
//! On a real directory (the simulator has no direct I/O), with small segments so that
//! segments are sealed while batches are still being written: every write reads back at
//! once (from memory while staged or queued, from the file after), every write lands,
//! sealed segments are cut to their records (no page padding left), a reopen reads the
//! same, verify is clean, and a writeback cache destages segments while batches are in
//! flight without losing any.

use condense_engine::cache_tier::{CacheConf, CacheMode};
use condense_engine::io::RealDir;
use condense_engine::sim::SimRng;
use condense_engine::{CacheDir, InitOptions, OpenOptions, Pool};
use std::path::Path;
use std::sync::Arc;

const BS: usize = 4096;
const THREADS: usize = 4;
/// Each thread's region of the volume.
const REGION: usize = 4 << 20;
const ROUNDS: u64 = 6;

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// Random (incompressible, unique) bytes for thread `t` in round `round`.
fn data(t: usize, round: u64, len: usize) -> Vec<u8> {
    let mut rng = SimRng::new(((t as u64) << 32) ^ round ^ 0xd1ec7);
    (0..len / 8)
        .flat_map(|_| rng.next_u64().to_le_bytes())
        .collect()
}

/// Write `piece` at `at` and read it back at once.
fn write_and_read_back(vol: &condense_engine::VolumeHandle, at: u64, piece: &[u8], t: usize) {
    if let Err(e) = vol.write_at(at, piece, false) {
        panic!("write of thread {t} at {at}: {e}");
    }
    let mut back = vec![0u8; piece.len()];
    if let Err(e) = vol.read_at(at, &mut back) {
        panic!("read back of thread {t} at {at}: {e}");
    }
    assert!(back == piece, "thread {t} at {at}: read back other data");
}

/// Every thread rewrites its region each round: 256 KiB writes (direct) and, in every other
/// round, the last 64 KiB again in 4 KiB writes (page cache), each read back at once — the
/// last round's data must be what is read in the end.
fn write_rounds(pool: &Arc<Pool>) {
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let vol = pool.volume("v");
            s.spawn(move || {
                let Ok(vol) = vol else { panic!("open volume") };
                for round in 0..ROUNDS {
                    let d = data(t, round, REGION);
                    let base = t * REGION;
                    for (i, piece) in d.chunks(256 << 10).enumerate() {
                        let at = (base + i * (256 << 10)) as u64;
                        write_and_read_back(&vol, at, piece, t);
                    }
                    if round % 2 == 1 {
                        let tail = REGION - (64 << 10);
                        for (i, piece) in d[tail..].chunks(BS).enumerate() {
                            let at = (base + tail + i * BS) as u64;
                            write_and_read_back(&vol, at, piece, t);
                        }
                    }
                }
            });
        }
    });
}

fn check_data(pool: &Arc<Pool>) -> TestResult {
    let vol = pool.volume("v")?;
    for t in 0..THREADS {
        let mut buf = vec![0u8; REGION];
        vol.read_at((t * REGION) as u64, &mut buf)?;
        assert!(buf == data(t, ROUNDS - 1, REGION), "thread {t}'s region");
    }
    Ok(())
}

/// No segment but the newest ends in the zero padding of a direct write.
fn check_sealed_segments_cut(dirs: &[&Path]) -> TestResult {
    let mut segs = Vec::new();
    for dir in dirs {
        for e in std::fs::read_dir(dir)? {
            let e = e?;
            let name = e.file_name().to_string_lossy().to_string();
            if name.starts_with("seg-") && name.ends_with(".dat") {
                segs.push((name, e.path()));
            }
        }
    }
    segs.sort();
    assert!(segs.len() > 3, "only {} segments", segs.len());
    segs.pop();
    for (name, path) in segs {
        let bytes = std::fs::read(&path)?;
        let tail = &bytes[bytes.len() - 64..];
        assert!(
            tail.iter().any(|&b| b != 0),
            "sealed {name} ({} bytes) ends in zeros",
            bytes.len()
        );
    }
    Ok(())
}

/// A new pool in `dir` with the volume "v" the threads write.
fn new_pool(dir: &Path, opts: OpenOptions) -> Result<Arc<Pool>, Box<dyn std::error::Error>> {
    let init = InitOptions {
        // Room for 256 records of 4128 bytes after the 64-byte header and 1000 bytes more:
        // a sealed segment ends inside a page.
        segment_bytes_target: (1 << 20) + 9256,
        ..Default::default()
    };
    Pool::init_path(dir, &init)?;
    let pool = Pool::open_path(dir, opts)?;
    pool.create_volume("v", (THREADS * REGION) as u64)?;
    Ok(pool)
}

/// Check the data, then close the pool.
fn check_and_close(pool: Arc<Pool>) -> TestResult {
    check_data(&pool)?;
    pool.close()?;
    Ok(())
}

/// Reopen the pool in `dir` with `opts` and check the data again.
fn reopen_and_check(
    dir: &Path,
    opts: OpenOptions,
) -> Result<Arc<Pool>, Box<dyn std::error::Error>> {
    let pool = Pool::open_path(dir, opts)?;
    check_data(&pool)?;
    Ok(pool)
}

#[test]
fn concurrent_direct_and_page_cache_batches_all_land() -> TestResult {
    let tmp = tempfile::tempdir()?;
    let pool = new_pool(tmp.path(), OpenOptions::default())?;
    write_rounds(&pool);
    check_and_close(pool)?;
    check_sealed_segments_cut(&[tmp.path()])?;
    let pool = reopen_and_check(tmp.path(), OpenOptions::default())?;
    assert!(pool.verify(&|_, _| {})?.is_clean());
    Ok(())
}

#[test]
fn a_writeback_cache_destages_while_batches_are_in_flight() -> TestResult {
    let tmp = tempfile::tempdir()?;
    let cache = tempfile::tempdir()?;
    let opts = || OpenOptions {
        cache_dir: Some(CacheDir(Arc::new(RealDir::new(cache.path())))),
        ..Default::default()
    };
    let pool = new_pool(tmp.path(), opts())?;
    pool.attach_cache(
        Arc::new(RealDir::new(cache.path())),
        CacheConf {
            path: cache.path().display().to_string(),
            size_bytes: 256 << 20,
            mode: CacheMode::WriteBack,
        },
    )?;
    write_rounds(&pool);
    check_and_close(pool)?;
    check_sealed_segments_cut(&[tmp.path(), cache.path()])?;
    let pool = reopen_and_check(tmp.path(), opts())?;
    pool.detach_cache(false)?;
    check_data(&pool)?;
    assert!(pool.verify(&|_, _| {})?.is_clean());
    Ok(())
}

/// GC collecting over and over while the writes overwrite their regions (a stress test: the
/// window where a sealed segment still has a batch in flight is narrow; the unit test
/// `segment::tests::a_segment_with_a_batch_in_flight_is_neither_destaged_nor_collectable`
/// covers it exactly).
#[test]
fn gc_running_beside_the_writes_loses_nothing() -> TestResult {
    let tmp = tempfile::tempdir()?;
    let pool = new_pool(tmp.path(), OpenOptions::default())?;
    let done = std::sync::atomic::AtomicBool::new(false);
    let mut collections = 0u32;
    std::thread::scope(|s| {
        let gc = s.spawn(|| {
            let mut n = 0u32;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                // Every round overwrites the last: sealed segments fill with dead records,
                // some of them sealed while their last batch is still being written.
                if let Err(e) = pool.gc(1) {
                    panic!("gc: {e}");
                }
                n += 1;
            }
            n
        });
        write_rounds(&pool);
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        collections = gc.join().unwrap_or_else(|_| panic!("gc thread panicked"));
    });
    assert!(collections > 0);
    check_and_close(pool)?;
    let pool = reopen_and_check(tmp.path(), OpenOptions::default())?;
    assert!(pool.verify(&|_, _| {})?.is_clean());
    Ok(())
}

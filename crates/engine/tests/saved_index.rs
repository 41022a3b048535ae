//! The dedup index saved at a clean close (`dedup.idx`): the next open loads it instead of
//! walking the chunk table, and dedup against the chunks written before goes on exactly;
//! after a crash, with a damaged file, or once a chunk was dropped before the first write,
//! the index is built from the chunk table instead, and nothing is lost either way.

use condense_engine::sim::{SimDir, SimHandle, SimRng};
use condense_engine::{Compression, InitOptions, OpenOptions, Pool};
use std::sync::Arc;

type TestResult = Result<(), Box<dyn std::error::Error>>;

const BLOCKS: usize = 2048;

fn random(seed: u64, blocks: usize) -> Vec<u8> {
    let mut rng = SimRng::new(seed);
    (0..blocks * 4096 / 8)
        .flat_map(|_| rng.next_u64().to_le_bytes())
        .collect()
}

fn open(disk: &Arc<SimDir>) -> Result<Arc<Pool>, condense_engine::Error> {
    Pool::open(Arc::new(SimHandle(disk.clone())), OpenOptions::default())
}

/// A pool with volume "a" holding `BLOCKS` unique blocks, closed cleanly.
fn pool_with_data() -> Result<(Arc<SimDir>, Vec<u8>), Box<dyn std::error::Error>> {
    let disk = SimDir::new();
    let init = InitOptions {
        compression: Compression::None,
        ..Default::default()
    };
    Pool::init(&SimHandle(disk.clone()), &init)?;
    let pool = open(&disk)?;
    let data = random(1, BLOCKS);
    pool.create_volume("a", 64 << 20)?;
    pool.volume("a")?.write_at(0, &data, false)?;
    pool.close()?;
    Ok((disk, data))
}

/// Write `data` again into a new volume: every block must deduplicate against "a".
fn write_duplicates(
    pool: &Pool,
    name: &str,
    data: &[u8],
) -> Result<String, Box<dyn std::error::Error>> {
    let before = pool.stats()?.unique_chunks;
    pool.create_volume(name, 64 << 20)?;
    pool.volume(name)?.write_at(0, data, false)?;
    let s = pool.stats()?;
    assert_eq!(
        s.unique_chunks, before,
        "every block of {name} deduplicated"
    );
    let mut back = vec![0u8; data.len()];
    pool.volume(name)?.read_at(0, &mut back)?;
    assert!(back == data, "{name} reads back what was written");
    Ok(s.dedup_index)
}

/// `pool_with_data`'s pool, 64 blocks of "a" written again and flushed, then dropped without
/// a close (the saved index names the root before these writes) and opened again: the
/// pool, the first data and the 64 blocks.
type Reopened = (Arc<Pool>, Vec<u8>, Vec<u8>);
fn reopened_after_a_crash() -> Result<Reopened, Box<dyn std::error::Error>> {
    let (disk, data) = pool_with_data()?;
    let pool = open(&disk)?;
    let more = random(3, 64);
    pool.volume("a")?.write_at(0, &more, false)?;
    pool.flush()?;
    drop(pool);
    Ok((open(&disk)?, data, more))
}

#[test]
fn a_clean_close_saves_the_index_and_the_next_open_loads_it() -> TestResult {
    let (disk, data) = pool_with_data()?;
    assert!(disk.file_len("dedup.idx").is_some_and(|n| n > 128));
    let pool = open(&disk)?;
    assert_eq!(pool.stats()?.dedup_index, "not built");
    assert_eq!(write_duplicates(&pool, "b", &data)?, "loaded");
    // New chunks go into the loaded index like into a built one.
    let more = random(2, 256);
    pool.volume("b")?.write_at(0, &more, false)?;
    assert_eq!(write_duplicates(&pool, "c", &more)?, "loaded");
    pool.close()?;
    // A session that only reads keeps the saved index usable (restamped at close).
    let pool = open(&disk)?;
    let mut one = vec![0u8; 4096];
    pool.volume("a")?.read_at(0, &mut one)?;
    pool.close()?;
    let pool = open(&disk)?;
    assert_eq!(write_duplicates(&pool, "d", &data)?, "loaded");
    assert!(pool.verify(&|_, _| {})?.is_clean());
    Ok(())
}

#[test]
fn after_a_crash_the_index_is_built_from_the_chunk_table() -> TestResult {
    let (pool, data, more) = reopened_after_a_crash()?;
    assert_eq!(write_duplicates(&pool, "b", &more)?, "built");
    // Blocks of `data` past what `more` overwrote still deduplicate.
    let tail = &data[more.len()..];
    let before = pool.stats()?.unique_chunks;
    pool.volume("b")?.write_at(more.len() as u64, tail, false)?;
    assert_eq!(pool.stats()?.unique_chunks, before);
    Ok(())
}

/// A served pool builds the index in steps after a crash: meanwhile a write is not held for
/// a walk of the whole chunk table (it misses instead), and once the build is over, every
/// block written before the crash and during the build deduplicates again.
#[test]
fn after_a_crash_a_served_pool_builds_the_index_in_steps() -> TestResult {
    let (pool, data, more) = reopened_after_a_crash()?;
    pool.start_index_build();
    let first = pool.stats()?.dedup_index;
    assert!(
        first == "building" || first == "built",
        "a build began: {first}"
    );
    // Written while the build may be under way: new chunks land past its cursor.
    let during = random(4, 512);
    pool.create_volume("during", 64 << 20)?;
    pool.volume("during")?.write_at(0, &during, false)?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while pool.stats()?.dedup_index != "built" {
        assert!(std::time::Instant::now() < deadline, "the build ends");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(write_duplicates(&pool, "b", &more)?, "built");
    assert_eq!(write_duplicates(&pool, "c", &during)?, "built");
    let tail = &data[more.len()..];
    let before = pool.stats()?.unique_chunks;
    pool.volume("b")?.write_at(more.len() as u64, tail, false)?;
    assert_eq!(
        pool.stats()?.unique_chunks,
        before,
        "data's tail deduplicated"
    );
    assert!(pool.verify(&|_, _| {})?.is_clean());
    Ok(())
}

#[test]
fn a_damaged_saved_index_is_ignored() -> TestResult {
    let (disk, data) = pool_with_data()?;
    let len = disk.file_len("dedup.idx").ok_or("no dedup.idx")?;
    disk.flip_bit("dedup.idx", len / 2, 3)?;
    let pool = open(&disk)?;
    assert_eq!(write_duplicates(&pool, "b", &data)?, "built");
    Ok(())
}

#[test]
fn a_chunk_dropped_before_the_first_write_makes_the_build_walk_the_table() -> TestResult {
    let (disk, data) = pool_with_data()?;
    let pool = open(&disk)?;
    pool.create_volume("x", 1 << 20)?;
    pool.volume("x")?.write_at(0, &random(4, 4), false)?;
    pool.close()?;
    let pool = open(&disk)?;
    // Deleting "x" and collecting removes its chunks from the table before anything
    // needed the index.
    pool.delete_volume("x")?;
    pool.finish_releases(&|_, _| {})?;
    pool.gc(0)?;
    assert_eq!(write_duplicates(&pool, "b", &data)?, "built");
    Ok(())
}

/// Lets the reads of `dedup.idx` go when dropped (also when a test fails half-way, so the
/// index thread it holds ends and the pool can be dropped).
struct LetGo<'a>(&'a SimDir);

impl Drop for LetGo<'_> {
    fn drop(&mut self) {
        let _ = self.0.hold_reads("dedup.idx", false);
    }
}

/// Wait until the pool's index is `want` (the background thread finished).
fn wait_for_index(pool: &Pool, want: &str) -> TestResult {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while pool.stats()?.dedup_index != want {
        assert!(
            std::time::Instant::now() < deadline,
            "the index became {want}"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    Ok(())
}

/// A served pool loads the saved index on a thread, without the state lock; the file's reads
/// are held here so that writes, an overwrite and a GC that drops chunks all happen while it
/// loads. Meanwhile lookups miss (duplicates are stored again: savings only). Once loaded,
/// the index holds exactly the live chunks (the chunks added meanwhile in, the dropped ones
/// out), every block reads back what was written, and the chunks added during the load are
/// found by later writes.
#[test]
fn a_served_pool_loads_the_saved_index_in_the_background() -> TestResult {
    let (disk, data) = pool_with_data()?;
    let pool = open(&disk)?;
    disk.hold_reads("dedup.idx", true)?;
    let let_go = LetGo(&disk);
    pool.start_index_build();
    assert_eq!(pool.stats()?.dedup_index, "loading");

    // While it loads: new data, data's first 64 blocks again (missed: stored again), then
    // those blocks of "a" overwritten and collected (their first copies dropped).
    let during = random(5, 256);
    pool.create_volume("during", 64 << 20)?;
    pool.volume("during")?.write_at(0, &during, false)?;
    let head = &data[..64 * 4096];
    let before = pool.stats()?.unique_chunks;
    pool.create_volume("again", 64 << 20)?;
    pool.volume("again")?.write_at(0, head, false)?;
    assert_eq!(
        pool.stats()?.unique_chunks,
        before + 64,
        "lookups miss while the index loads"
    );
    let other = random(6, 64);
    pool.volume("a")?.write_at(0, &other, false)?;
    pool.gc(0)?;
    assert_eq!(pool.stats()?.dedup_index, "loading", "the load was held");

    drop(let_go);
    wait_for_index(&pool, "loaded")?;
    let s = pool.stats()?;
    assert_eq!(
        s.dedup_index_entries, s.unique_chunks,
        "the index names every live chunk once: the changes made while it loaded applied"
    );
    // Found by later writes: chunks of the file, and chunks added while it loaded.
    assert_eq!(write_duplicates(&pool, "b", &during)?, "loaded");
    assert_eq!(write_duplicates(&pool, "c", head)?, "loaded");
    assert_eq!(write_duplicates(&pool, "d", &data[64 * 4096..])?, "loaded");
    assert_eq!(write_duplicates(&pool, "e", &other)?, "loaded");
    let mut back = vec![0u8; data.len()];
    pool.volume("a")?.read_at(0, &mut back)?;
    assert!(back[..other.len()] == other[..], "a's overwritten head");
    assert!(back[other.len()..] == data[other.len()..], "a's tail");
    assert!(pool.verify(&|_, _| {})?.is_clean());
    // The close saves the index it ends with; the next open loads it.
    pool.close()?;
    let pool = open(&disk)?;
    assert_eq!(write_duplicates(&pool, "f", &during)?, "loaded");
    Ok(())
}

/// A served pool whose saved index fails its checks builds the index from the chunk table in
/// steps instead, and dedup is exact again once it is built.
#[test]
fn a_served_pool_with_a_damaged_saved_index_builds_it_in_steps() -> TestResult {
    let (disk, data) = pool_with_data()?;
    let len = disk.file_len("dedup.idx").ok_or("no dedup.idx")?;
    disk.flip_bit("dedup.idx", len / 2, 5)?;
    let pool = open(&disk)?;
    pool.start_index_build();
    wait_for_index(&pool, "built")?;
    assert_eq!(write_duplicates(&pool, "b", &data)?, "built");
    Ok(())
}

/// A pool closed while its saved index loads waits for the load, and saves the index.
#[test]
fn a_close_during_the_load_saves_the_loaded_index() -> TestResult {
    let (disk, data) = pool_with_data()?;
    let pool = open(&disk)?;
    disk.hold_reads("dedup.idx", true)?;
    let let_go = LetGo(&disk);
    pool.start_index_build();
    let more = random(7, 32);
    pool.create_volume("more", 64 << 20)?;
    pool.volume("more")?.write_at(0, &more, false)?;
    let closer = {
        let pool = pool.clone();
        std::thread::spawn(move || pool.close())
    };
    std::thread::sleep(std::time::Duration::from_millis(20));
    drop(let_go);
    closer.join().map_err(|_| "the close panicked")??;
    drop(pool);
    let pool = open(&disk)?;
    assert_eq!(write_duplicates(&pool, "b", &data)?, "loaded");
    assert_eq!(write_duplicates(&pool, "c", &more)?, "loaded");
    Ok(())
}

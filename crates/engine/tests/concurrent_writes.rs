//! Many threads writing one volume at once: whole-block writes (which run without the volume
//! lock) and partial-block writes to different bytes of the same blocks (read-modify-write
//! under the volume lock) must all land, with none lost.

use condense_engine::sim::{SimDir, SimHandle, SimRng};
use condense_engine::{InitOptions, OpenOptions, Pool};
use std::sync::Arc;

const BS: usize = 4096;
const THREADS: usize = 4;
const OWN_BLOCKS: usize = 64;
const SHARED_BLOCKS: usize = 4;
const ROUNDS: u64 = 100;

#[test]
fn concurrent_whole_and_partial_block_writes_all_land() -> Result<(), Box<dyn std::error::Error>> {
    let disk = SimDir::new();
    Pool::init(&SimHandle(disk.clone()), &InitOptions::default())?;
    let pool = Pool::open(Arc::new(SimHandle(disk)), OpenOptions::default())?;
    let size = (THREADS * OWN_BLOCKS + SHARED_BLOCKS) * BS;
    pool.create_volume("v", size as u64)?;
    let data = |t: usize, round: u64| -> Vec<u8> {
        let mut rng = SimRng::new(t as u64 * 1000 + round);
        (0..OWN_BLOCKS * BS / 8)
            .flat_map(|_| rng.next_u64().to_le_bytes())
            .collect()
    };
    let shared_base = THREADS * OWN_BLOCKS * BS;
    let slot = BS / THREADS;
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let vol = pool.volume("v");
            s.spawn(move || {
                let Ok(vol) = vol else { panic!("open") };
                for round in 0..ROUNDS {
                    // Whole blocks of this thread's own range, in 16 KiB writes.
                    let d = data(t, round);
                    for (i, piece) in d.chunks(4 * BS).enumerate() {
                        let at = (t * OWN_BLOCKS * BS + i * 4 * BS) as u64;
                        if let Err(e) = vol.write_at(at, piece, false) {
                            panic!("write: {e}");
                        }
                    }
                    // This thread's slot in every shared block: partial-block writes.
                    for b in 0..SHARED_BLOCKS {
                        let at = (shared_base + b * BS + t * slot) as u64;
                        let fill = vec![(t as u8 + 1) ^ (round as u8); slot];
                        if let Err(e) = vol.write_at(at, &fill, false) {
                            panic!("partial write: {e}");
                        }
                    }
                }
            });
        }
    });
    let vol = pool.volume("v")?;
    for t in 0..THREADS {
        let mut buf = vec![0u8; OWN_BLOCKS * BS];
        vol.read_at((t * OWN_BLOCKS * BS) as u64, &mut buf)?;
        assert!(buf == data(t, ROUNDS - 1), "thread {t}'s blocks");
    }
    for b in 0..SHARED_BLOCKS {
        let mut buf = vec![0u8; BS];
        vol.read_at((shared_base + b * BS) as u64, &mut buf)?;
        for t in 0..THREADS {
            let want = (t as u8 + 1) ^ (ROUNDS - 1) as u8;
            assert!(
                buf[t * slot..(t + 1) * slot].iter().all(|&x| x == want),
                "shared block {b}, slot of thread {t}"
            );
        }
    }
    pool.close()?;
    let report = pool.verify(&|_, _| {})?;
    assert!(report.is_clean());
    Ok(())
}

/// Checkpoints write most dirty metadata pages without the state lock while writes go on
/// (docs/FORMAT.md "Durability protocol"): a page changed while its old bytes were being
/// written must keep the change. One thread writes blocks spread over 200 block-map leaves
/// (so every checkpoint has pages to write outside the lock) while snapshots are taken; after
/// a close and a reopen every write is there and verify is clean. (The race is timing's: a few
/// pools make missing it unlikely.)
#[test]
fn writes_during_checkpoints_outside_the_lock_all_land() -> Result<(), Box<dyn std::error::Error>> {
    for _ in 0..4 {
        writes_during_snapshots()?;
    }
    Ok(())
}

fn writes_during_snapshots() -> Result<(), Box<dyn std::error::Error>> {
    const LEAVES: u64 = 200;
    const ROUNDS: u64 = 40;
    const PER_LEAF: u64 = 512;
    let disk = SimDir::new();
    Pool::init(&SimHandle(disk.clone()), &InitOptions::default())?;
    let pool = Pool::open(Arc::new(SimHandle(disk.clone())), OpenOptions::default())?;
    pool.create_volume("v", LEAVES * PER_LEAF * BS as u64)?;
    let block = |leaf: u64, round: u64| -> Vec<u8> {
        let mut rng = SimRng::new(leaf * 1000 + round + 1);
        (0..BS / 8)
            .flat_map(|_| rng.next_u64().to_le_bytes())
            .collect()
    };
    let done = std::sync::atomic::AtomicBool::new(false);
    let mut snapshots = 0;
    std::thread::scope(|s| -> Result<(), Box<dyn std::error::Error>> {
        let vol = pool.volume("v")?;
        let (block, done) = (&block, &done);
        s.spawn(move || {
            for round in 0..ROUNDS {
                for leaf in 0..LEAVES {
                    let at = (leaf * PER_LEAF + round) * BS as u64;
                    if let Err(e) = vol.write_at(at, &block(leaf, round), false) {
                        panic!("write: {e}");
                    }
                }
            }
            done.store(true, std::sync::atomic::Ordering::Relaxed);
        });
        while !done.load(std::sync::atomic::Ordering::Relaxed) {
            pool.create_snapshot("v", &format!("s{snapshots}"))?;
            snapshots += 1;
        }
        Ok(())
    })?;
    assert!(
        snapshots > 1,
        "snapshots were taken while the writes went on"
    );
    pool.close()?;
    drop(pool);
    let pool = Pool::open(Arc::new(SimHandle(disk)), OpenOptions::default())?;
    let vol = pool.volume("v")?;
    for round in 0..ROUNDS {
        for leaf in 0..LEAVES {
            let mut buf = vec![0u8; BS];
            vol.read_at((leaf * PER_LEAF + round) * BS as u64, &mut buf)?;
            assert!(buf == block(leaf, round), "leaf {leaf}, round {round}");
        }
    }
    let report = pool.verify(&|_, _| {})?;
    assert!(report.is_clean());
    Ok(())
}

//! The background GC trigger reclaims dead space on its own once it passes the threshold, and
//! leaves live data readable.

use condense_engine::gc::BackgroundGc;
use condense_engine::sim::{SimDir, SimHandle};

use condense_engine::{InitOptions, OpenOptions, Pool};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[test]
fn background_gc_reclaims_dead_space() -> Result<(), Box<dyn std::error::Error>> {
    let disk = SimDir::new();
    let init = InitOptions {
        segment_bytes_target: 1 << 20,
        ..Default::default()
    };
    Pool::init(&SimHandle(disk.clone()), &init)?;
    let pool = Pool::open(Arc::new(SimHandle(disk.clone())), OpenOptions::default())?;
    pool.create_volume("keep", 8 << 20)?;
    pool.create_volume("drop", 8 << 20)?;
    let data = |seed: u64| -> Vec<u8> {
        let mut rng = condense_engine::sim::SimRng::new(seed);
        (0..1u32 << 20)
            .flat_map(|_| rng.next_u64().to_le_bytes())
            .collect()
    };
    pool.volume("drop")?.write_at(0, &data(1), false)?;
    pool.volume("keep")?.write_at(0, &data(2), false)?;
    pool.delete_volume("drop")?;
    pool.close()?;
    let (_, dead_before) = pool.dead_space();
    assert!(dead_before > 4 << 20, "dead {dead_before}");
    let gc = BackgroundGc::start(&pool, Duration::from_millis(200), 10, 1 << 20);
    let start = Instant::now();
    while pool.dead_space().1 * 10 > dead_before && start.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(gc);
    let (_, dead_after) = pool.dead_space();
    assert!(
        dead_after * 10 <= dead_before,
        "background gc left {dead_after} of {dead_before} dead bytes"
    );
    let mut buf = vec![0u8; 8 << 20];
    pool.volume("keep")?.read_at(0, &mut buf)?;
    assert!(buf == data(2));
    Ok(())
}

/// A volume overwritten faster than the periodic check runs: the writes that find the disk
/// low on space wake the background GC at once, so overwrites go on (a client retrying a
/// write refused for space, as the error asks) instead of filling the disk with dead chunks.
#[test]
fn low_space_wakes_the_background_gc() -> Result<(), Box<dyn std::error::Error>> {
    let disk = SimDir::new();
    let init = InitOptions {
        segment_bytes_target: 1 << 20,
        ..Default::default()
    };
    Pool::init(&SimHandle(disk.clone()), &init)?;
    disk.set_capacity(48 << 20);
    let opts = OpenOptions {
        reserve_bytes: 4 << 20,
        low_space_bytes: 16 << 20,
        ..Default::default()
    };
    let pool = Pool::open(Arc::new(SimHandle(disk.clone())), opts)?;
    pool.create_volume("vm", 8 << 20)?;
    // The periodic check never comes during the test: only low space can wake GC.
    let gc = BackgroundGc::start(&pool, Duration::from_secs(3600), 25, 1 << 20);
    let data = |seed: u64| -> Vec<u8> {
        let mut rng = condense_engine::sim::SimRng::new(seed);
        (0..1u32 << 20)
            .flat_map(|_| rng.next_u64().to_le_bytes())
            .collect()
    };
    // 20 overwrites of 8 MiB of unique data: 160 MiB through a 48 MiB disk.
    for round in 0..20u64 {
        let want = data(round);
        let start = Instant::now();
        loop {
            match pool.volume("vm")?.write_at(0, &want, false) {
                Ok(_) => break,
                Err(e) if start.elapsed() < Duration::from_secs(20) => {
                    assert!(e.to_string().contains("free"), "round {round}: {e}");
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => {
                    return Err(format!("round {round}: still refused after 20 s: {e}").into())
                }
            }
        }
        pool.flush()?;
    }
    drop(gc);
    let mut buf = vec![0u8; 8 << 20];
    pool.volume("vm")?.read_at(0, &mut buf)?;
    assert!(buf == data(19), "the last overwrite reads back");
    Ok(())
}

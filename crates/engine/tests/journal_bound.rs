//! A writer that never flushes (an import, a guest with cache=unsafe) still checkpoints the
//! journal once it passes `journal_bytes_max` (crates/engine/src/pool/mod.rs `journal_full`):
//! a crash then replays at most about that much at the next open, not everything written
//! since the last flush.

use condense_engine::sim::{SimDir, SimHandle, SimRng};
use condense_engine::{InitOptions, OpenOptions, Pool};
use std::sync::Arc;

const BS: usize = 4096;

fn opts() -> OpenOptions {
    OpenOptions {
        destage_in_background: false,
        release_in_background: false,
        journal_bytes_max: 64 << 10,
        ..Default::default()
    }
}

#[test]
fn writes_without_flushes_keep_the_journal_bounded() -> Result<(), Box<dyn std::error::Error>> {
    let disk = SimDir::new();
    Pool::init(&SimHandle(disk.clone()), &InitOptions::default())?;
    let pool = Pool::open(Arc::new(SimHandle(disk.clone())), opts())?;
    let blocks = 8192u64;
    pool.create_volume("v", blocks * BS as u64)?;
    let h = pool.volume("v")?;
    let before = pool.counters();
    let mut rng = SimRng::new(5);
    for b in 0..blocks {
        let data: Vec<u8> = (0..BS / 8)
            .flat_map(|_| rng.next_u64().to_le_bytes())
            .collect();
        h.write_at(b * BS as u64, &data, false)?;
    }
    let after = pool.counters();
    let records = after.journal_records - before.journal_records;
    assert!(records >= blocks, "{before:?} -> {after:?}");
    // Each write journals tens of bytes: 8,192 writes pass 64 KiB several times.
    assert!(
        after.checkpoints >= before.checkpoints + 2,
        "no checkpoint without a flush: {before:?} -> {after:?}"
    );
    let crashed = disk.crash(&mut SimRng::new(9));
    drop(h);
    drop(pool);
    let pool = Pool::open(Arc::new(SimHandle(crashed)), opts())?;
    let replayed = pool.replay_report().records;
    assert!(
        replayed * 3 < records,
        "the replay after the crash covered {replayed} of {records} records"
    );
    assert!(pool.verify(&|_, _| {})?.is_clean());
    Ok(())
}

//! The activity counters (`Pool::counters`) move by what was done: journal records per
//! write, one flush and one journal sync per flush with something to sync, one checkpoint per
//! checkpoint, and a GC run with the bytes it gave back and its progress at the end.

use condense_engine::sim::{SimDir, SimHandle, SimRng};
use condense_engine::{InitOptions, OpenOptions, Pool};
use std::sync::Arc;

#[test]
fn counters_follow_writes_flushes_checkpoints_and_gc() -> Result<(), Box<dyn std::error::Error>> {
    let disk = SimDir::new();
    let init = InitOptions {
        segment_bytes_target: 1 << 20,
        ..Default::default()
    };
    Pool::init(&SimHandle(disk.clone()), &init)?;
    let pool = Pool::open(Arc::new(SimHandle(disk)), OpenOptions::default())?;
    let c0 = pool.counters();
    assert_eq!(c0.flushes, 0);
    assert!(!c0.gc_running);

    pool.create_volume("keep", 4 << 20)?;
    pool.create_volume("drop", 4 << 20)?;
    let data = |seed: u64| -> Vec<u8> {
        let mut rng = SimRng::new(seed);
        (0..1u32 << 19)
            .flat_map(|_| rng.next_u64().to_le_bytes())
            .collect()
    };
    pool.volume("keep")?.write_at(0, &data(1), false)?;
    let c1 = pool.counters();
    assert!(
        c1.journal_records >= c0.journal_records + 1024,
        "1024 new blocks journal at least one record each: {c0:?} -> {c1:?}"
    );
    pool.flush()?;
    let c2 = pool.counters();
    assert_eq!(c2.flushes, c1.flushes + 1);
    assert_eq!(c2.journal_syncs, c1.journal_syncs + 1);
    assert!(c2.journal_sync_time <= c2.flush_time);
    pool.flush()?; // nothing to make durable: not a flush that syncs
    assert_eq!(pool.counters().flushes, c2.flushes);

    pool.volume("drop")?.write_at(0, &data(2), false)?;
    pool.delete_volume("drop")?;
    let c3 = pool.counters();
    let (_, dead) = pool.dead_space();
    assert!(dead > 1 << 20, "dead {dead}");
    let report = pool.gc(1)?;
    let c4 = pool.counters();
    assert_eq!(c4.gc_runs, c3.gc_runs + 1);
    assert!(!c4.gc_running);
    assert!(c4.checkpoints > c3.checkpoints, "GC ends with a checkpoint");
    assert!(c4.checkpoint_last_time <= c4.checkpoint_time);
    assert_eq!(
        c4.gc_reclaimed_bytes - c3.gc_reclaimed_bytes,
        report.bytes_before - report.bytes_after
    );
    assert!(c4.gc_reclaimed_bytes > 0);
    assert_eq!(c4.gc_segments_removed, report.segments_removed);
    assert_eq!(c4.gc_chunks_moved, report.chunks_moved);
    assert!(c4.gc_chunk_ids > 0);
    assert_eq!(
        c4.gc_scanned_chunk_ids, c4.gc_chunk_ids,
        "a finished GC scanned everything"
    );
    Ok(())
}

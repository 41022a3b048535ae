//! Per-volume physical share: shared chunks are divided among the blocks that use them, so the
//! shares add up to the pool's data and `du` on the FUSE mount stays honest.

use condense_engine::sim::{SimDir, SimHandle, SimRng};
use condense_engine::{Compression, InitOptions, OpenOptions, Pool};
use std::sync::Arc;

#[test]
fn shared_chunks_are_split_between_volumes() -> Result<(), Box<dyn std::error::Error>> {
    let disk = SimDir::new();
    let init = InitOptions {
        compression: Compression::None,
        ..Default::default()
    };
    Pool::init(&SimHandle(disk.clone()), &init)?;
    let pool = Pool::open(Arc::new(SimHandle(disk)), OpenOptions::default())?;
    let mut rng = SimRng::new(5);
    let shared: Vec<u8> = (0..1u32 << 17)
        .flat_map(|_| rng.next_u64().to_le_bytes())
        .collect();
    let own: Vec<u8> = (0..1u32 << 17)
        .flat_map(|_| rng.next_u64().to_le_bytes())
        .collect();
    for v in ["a", "b"] {
        pool.create_volume(v, 4 << 20)?;
        pool.volume(v)?.write_at(0, &shared, false)?;
    }
    pool.volume("b")?.write_at(1 << 20, &own, false)?;
    let record = 4096 + 32;
    let blocks = (1u64 << 20) / 4096;
    assert_eq!(pool.volume_physical_bytes("a")?, blocks * record / 2);
    assert_eq!(
        pool.volume_physical_bytes("b")?,
        blocks * record / 2 + blocks * record
    );
    let s = pool.stats()?;
    let sum: u64 = s.volumes.iter().map(|v| v.physical_bytes).sum();
    assert_eq!(sum, 3 * blocks * record / 2 + blocks * record / 2);
    assert_eq!(s.unique_chunks, 2 * blocks);
    assert!(pool.volume_physical_bytes("nosuch").is_err());
    Ok(())
}

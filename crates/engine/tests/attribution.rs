//! Exact per-volume and per-snapshot figures (docs/STATS.md): the chunks only one volume or
//! snapshot names and those it shares, kept as volumes are written, snapshotted, cloned,
//! rolled back and deleted; what deleting one frees is what its figure said; the sum rule.

use condense_engine::sim::{SimDir, SimHandle, SimRng};
use condense_engine::{Compression, InitOptions, OpenOptions, Pool, PoolStats, VolumeStats};
use std::sync::Arc;

type R = Result<(), Box<dyn std::error::Error>>;

const BS: usize = 4096;

fn random_blocks(rng: &mut SimRng, blocks: usize) -> Vec<u8> {
    (0..blocks * BS / 8)
        .flat_map(|_| rng.next_u64().to_le_bytes())
        .collect()
}

fn find<'a>(s: &'a PoolStats, name: &str) -> &'a VolumeStats {
    match s
        .volumes
        .iter()
        .chain(&s.snapshots)
        .find(|v| v.name == name)
    {
        Some(v) => v,
        None => panic!("{name} is not in the statistics"),
    }
}

/// (exclusive chunks, shared chunks) of `name`.
fn chunks(s: &PoolStats, name: &str) -> (u64, u64) {
    match find(s, name).space {
        Some(t) => (t.exclusive.chunks, t.shared.chunks),
        None => panic!("no figures for {name}: {:?}", s.attribution_error),
    }
}

/// Every volume's and snapshot's exclusive bytes plus the pool's shared bytes are the live
/// chunk bytes.
fn sum_rule_holds(s: &PoolStats) {
    let exclusive: u64 = s
        .volumes
        .iter()
        .chain(&s.snapshots)
        .filter_map(|v| v.exclusive_bytes())
        .sum();
    let shared = s.shared.map_or(0, |x| x.record_bytes());
    // Chunks only a deleted map being released still names are nobody's (docs/STATS.md).
    assert_eq!(
        exclusive + shared + s.releasing_bytes,
        s.chunk_bytes,
        "sum rule"
    );
}

/// A simulated disk holding a new pool made with `init`.
fn new_disk(init: &InitOptions) -> Result<Arc<SimDir>, Box<dyn std::error::Error>> {
    let disk = SimDir::new();
    Pool::init(&SimHandle(disk.clone()), init)?;
    Ok(disk)
}

/// The pool on `disk`, opened (again). The figures' pages are 16 words and each array keeps
/// 2 in RAM, so every test here runs with them spilled to the scratch file as a pool far
/// beyond RAM would.
fn open(disk: &Arc<SimDir>) -> Result<Arc<Pool>, Box<dyn std::error::Error>> {
    Ok(Pool::open(
        Arc::new(SimHandle(disk.clone())),
        OpenOptions {
            attribution_pages: Some((16, 2)),
            count_step_time: std::time::Duration::ZERO,
            ..Default::default()
        },
    )?)
}

#[test]
fn figures_follow_writes_snapshots_clones_and_deletes() -> R {
    let init = InitOptions {
        compression: Compression::None,
        ..Default::default()
    };
    let pool = open(&new_disk(&init)?)?;
    let mut rng = SimRng::new(27);
    let common = random_blocks(&mut rng, 16);
    let a_own = random_blocks(&mut rng, 24);
    let b_own = random_blocks(&mut rng, 8);
    for v in ["a", "b"] {
        pool.create_volume(v, 1 << 20)?;
        pool.volume(v)?.write_at(0, &common, false)?;
    }
    // Figures asked for once: from now on they are kept, not counted.
    pool.stats()?;
    pool.volume("a")?.write_at(64 << 10, &a_own, false)?;
    // The same 8 blocks twice in b: 8 chunks, 16 blocks, dedup 2x within b.
    pool.volume("b")?.write_at(64 << 10, &b_own, false)?;
    pool.volume("b")?.write_at(128 << 10, &b_own, false)?;
    let s = pool.stats()?;
    assert_eq!(chunks(&s, "a"), (24, 16));
    assert_eq!(chunks(&s, "b"), (8, 16));
    assert_eq!(s.shared.map(|x| x.chunks), Some(16));
    assert_eq!(find(&s, "b").dedup_ratio, Some(32.0 / 24.0));
    assert_eq!(find(&s, "a").dedup_ratio, Some(1.0));
    sum_rule_holds(&s);
    pool.check_attribution()?;
    assert!(
        s.attribution_scratch_bytes > 0,
        "the figures' pages went to the scratch file"
    );

    // A snapshot names everything a does: nothing is a's alone any more. Overwriting 4
    // blocks of a leaves their old chunks to the snapshot alone.
    pool.create_snapshot("a", "s")?;
    let s = pool.stats()?;
    assert_eq!(chunks(&s, "a"), (0, 40));
    assert_eq!(chunks(&s, "a@s"), (0, 40));
    pool.volume("a")?
        .write_at(64 << 10, &random_blocks(&mut rng, 4), false)?;
    let s = pool.stats()?;
    assert_eq!(chunks(&s, "a"), (4, 36));
    assert_eq!(chunks(&s, "a@s"), (4, 36));
    sum_rule_holds(&s);
    pool.check_attribution()?;

    // A clone of b and a rollback of a to its snapshot.
    pool.clone_volume("b", "c")?;
    pool.rollback_volume("a", "s", false)?;
    // a's old map is released in the background: wait for it, so what GC frees below is b's
    // alone (else the 4 chunks only the old map held are freed too, when the release ends
    // after `before` is read).
    pool.finish_releases(&|_, _| {})?;
    let s = pool.stats()?;
    assert_eq!(chunks(&s, "a"), (0, 40));
    assert_eq!(chunks(&s, "b"), (0, 24));
    assert_eq!(chunks(&s, "c"), (0, 24));
    sum_rule_holds(&s);
    pool.check_attribution()?;

    // Deleting the clone gives b its 8 chunks back; deleting b then frees exactly what its
    // figure said, once GC runs.
    pool.delete_volume("c")?;
    let s = pool.stats()?;
    assert_eq!(chunks(&s, "b"), (8, 16));
    let freeable = find(&s, "b").exclusive_bytes();
    let before = s.chunk_bytes;
    pool.delete_volume("b")?;
    // Its map is released in the background; GC frees what the release let go.
    pool.finish_releases(&|_, _| {})?;
    pool.gc(0)?;
    let s = pool.stats()?;
    assert_eq!(Some(before - s.chunk_bytes), freeable);
    // The 16 common chunks are a's and its snapshot's now, shared by the two of them.
    assert_eq!(chunks(&s, "a"), (0, 40));
    sum_rule_holds(&s);
    pool.check_attribution()?;

    // After a reopen the figures are counted again, and agree.
    pool.close()?;
    Ok(())
}

#[test]
fn a_reopened_pool_counts_the_same_figures() -> R {
    let disk = new_disk(&InitOptions::default())?;
    let mut rng = SimRng::new(3);
    let data = random_blocks(&mut rng, 32);
    let kept = {
        let pool = open(&disk)?;
        pool.create_volume("x", 1 << 20)?;
        pool.stats()?;
        pool.volume("x")?.write_at(0, &data, false)?;
        pool.create_snapshot("x", "one")?;
        pool.volume("x")?.write_at(4096, &data[..8 * BS], false)?;
        let s = pool.stats()?;
        pool.close()?;
        s
    };
    let pool = open(&disk)?;
    let counted = pool.stats()?;
    for name in ["x", "x@one"] {
        assert_eq!(
            find(&kept, name).space,
            find(&counted, name).space,
            "{name}"
        );
    }
    sum_rule_holds(&counted);
    Ok(())
}

/// The first count after an open is made in steps (the state lock let go between them) while
/// the volumes go on changing: writes behind the walk are applied to the count, writes ahead
/// of it are left for the walk to see, and a snapshot made meanwhile starts the count again.
/// Whatever the interleaving, the result equals a count from scratch.
#[test]
fn figures_counted_in_steps_while_volumes_change_match_a_count_from_scratch() -> R {
    const LEAF_BLOCKS: u64 = 512;
    const LEAVES: u64 = 256; // 4 steps of 64 leaves per volume
    let disk = new_disk(&InitOptions::default())?;
    let mut rng = SimRng::new(26);
    let shared = random_blocks(&mut rng, 8);
    let vols = ["p", "q", "r"];
    {
        let pool = open(&disk)?;
        for v in vols {
            pool.create_volume(v, LEAVES * LEAF_BLOCKS * BS as u64)?;
            let h = pool.volume(v)?;
            // One block in every leaf: some chunks the three share, most their own.
            for leaf in 0..LEAVES {
                let block = if rng.chance(30) {
                    let i = rng.below(8) as usize;
                    shared[i * BS..(i + 1) * BS].to_vec()
                } else {
                    random_blocks(&mut rng, 1)
                };
                h.write_at(leaf * LEAF_BLOCKS * BS as u64, &block, false)?;
            }
        }
        pool.close()?;
    }
    let pool = open(&disk)?;
    let (mut steps, mut snapshot_made) = (0, false);
    while !pool.count_figures_step()? {
        steps += 1;
        // Between steps: overwrites and new blocks anywhere, behind the walk and ahead of it.
        for _ in 0..4 {
            let v = vols[rng.below(3) as usize];
            let block = rng.below(LEAVES) * LEAF_BLOCKS + rng.below(2);
            let data = if rng.chance(50) {
                let i = rng.below(8) as usize;
                shared[i * BS..(i + 1) * BS].to_vec()
            } else {
                random_blocks(&mut rng, 1)
            };
            pool.volume(v)?.write_at(block * BS as u64, &data, false)?;
        }
        if steps == 9 {
            pool.create_snapshot("q", "mid")?;
            snapshot_made = true;
        }
        assert!(steps < 10_000, "the count never ends");
    }
    assert!(
        snapshot_made && steps > 20,
        "{steps} steps: too few to interleave"
    );
    pool.check_attribution()?;
    sum_rule_holds(&pool.stats()?);
    Ok(())
}

/// The count's steps go from one existing leaf to the next: an exabyte volume with a block at
/// each end takes a handful of steps, not one per 16 leaves of its address space.
/// A snapshot or clone of a volume, made while the figures are kept, is counted in steps (the
/// state lock let go between them) while the source, the clone and others are written; a
/// delete meanwhile is handled too. The figures then match a count from scratch.
#[test]
fn snapshots_and_clones_made_while_figures_are_kept_are_counted_in_steps() -> R {
    const LEAF_BLOCKS: u64 = 512;
    const LEAVES: u64 = 128;
    let pool = open(&new_disk(&InitOptions::default())?)?;
    let mut rng = SimRng::new(28);
    let shared = random_blocks(&mut rng, 8);
    let block_of = |rng: &mut SimRng| {
        if rng.chance(40) {
            let i = rng.below(8) as usize;
            shared[i * BS..(i + 1) * BS].to_vec()
        } else {
            random_blocks(rng, 1)
        }
    };
    for v in ["p", "q"] {
        pool.create_volume(v, LEAVES * LEAF_BLOCKS * BS as u64)?;
        for leaf in 0..LEAVES {
            let data = block_of(&mut rng);
            pool.volume(v)?
                .write_at(leaf * LEAF_BLOCKS * BS as u64, &data, false)?;
        }
    }
    pool.count_figures()?;
    pool.check_attribution()?;
    // Figures kept: a snapshot and a clone of p are walked in steps, not at once.
    pool.create_snapshot("p", "s")?;
    pool.clone_volume("p@s", "c")?;
    let mut steps = 0;
    while !pool.count_figures_step()? {
        steps += 1;
        for v in ["p", "c", "q", "c"] {
            let block = rng.below(LEAVES) * LEAF_BLOCKS + rng.below(2);
            let data = block_of(&mut rng);
            pool.volume(v)?.write_at(block * BS as u64, &data, false)?;
        }
        if steps == 3 {
            // A tree queued behind the walk, then released before it was walked.
            pool.create_snapshot("q", "gone")?;
            pool.delete_snapshot("q", "gone")?;
        }
        assert!(steps < 10_000, "the walk never ends");
    }
    assert!(
        steps >= 8,
        "{steps} steps: the new trees were not walked in steps"
    );
    // The deleted snapshot's map is released (in the background, or here): then the
    // figures account for every live chunk.
    pool.finish_releases(&|_, _| {})?;
    pool.check_attribution()?;
    let s = pool.stats()?;
    sum_rule_holds(&s);
    assert!(chunks(&s, "p@s").1 > 0, "the snapshot shares p's chunks");
    Ok(())
}

#[test]
fn counting_a_huge_sparse_volume_takes_steps_per_leaf_written() -> R {
    let disk = new_disk(&InitOptions::default())?;
    let mut rng = SimRng::new(1);
    let size = 1u64 << 60;
    {
        let pool = open(&disk)?;
        pool.create_volume("huge", size)?;
        let h = pool.volume("huge")?;
        for at in [0, size / 2, size - BS as u64] {
            h.write_at(at, &random_blocks(&mut rng, 1), false)?;
        }
        pool.close()?;
    }
    let pool = open(&disk)?;
    let mut steps = 0;
    while !pool.count_figures_step()? {
        steps += 1;
        assert!(steps < 100, "{steps} steps for 3 leaves");
    }
    assert_eq!(chunks(&pool.stats()?, "huge"), (3, 0));
    pool.check_attribution()?;
    Ok(())
}

/// A delete or rollback of a big map detaches it and releases it in steps: the figures are
/// kept through the release (never dropped and counted again), each step taking off the
/// entries it releases, and after every step they match a count from scratch. A map being
/// released when the pool opens is counted too, and its steps interleave with the count's.
#[test]
fn a_big_delete_or_rollback_keeps_the_figures_through_its_release() -> R {
    const LEAF_BLOCKS: u64 = 512;
    const LEAVES: u64 = 48;
    let disk = new_disk(&InitOptions::default())?;
    let open_stepped = || {
        Pool::open(
            Arc::new(SimHandle(disk.clone())),
            OpenOptions {
                attribution_pages: Some((16, 2)),
                count_step_time: std::time::Duration::ZERO,
                release_in_background: false,
                release_step_leaves: 1,
                ..Default::default()
            },
        )
    };
    let pool = open_stepped()?;
    let mut rng = SimRng::new(44);
    let shared = random_blocks(&mut rng, 8);
    let block_of = |rng: &mut SimRng| {
        if rng.chance(40) {
            let i = rng.below(8) as usize;
            shared[i * BS..(i + 1) * BS].to_vec()
        } else {
            random_blocks(rng, 1)
        }
    };
    let scribble = |pool: &Pool, rng: &mut SimRng, v: &str| -> R {
        let block = rng.below(LEAVES) * LEAF_BLOCKS + rng.below(2);
        let data = block_of(rng);
        pool.volume(v)?.write_at(block * BS as u64, &data, false)?;
        Ok(())
    };
    for v in ["p", "q", "r"] {
        pool.create_volume(v, LEAVES * LEAF_BLOCKS * BS as u64)?;
        for leaf in 0..LEAVES {
            let data = block_of(&mut rng);
            pool.volume(v)?
                .write_at(leaf * LEAF_BLOCKS * BS as u64, &data, false)?;
        }
    }
    pool.create_snapshot("p", "s")?;
    for _ in 0..LEAVES {
        scribble(&pool, &mut rng, "p")?;
    }
    pool.count_figures()?;

    // Each release step keeps the figures whole, checked against a count from scratch,
    // while `written` are written between steps.
    let release_keeping_figures = |pool: &Pool,
                                   rng: &mut SimRng,
                                   written: &[&str]|
     -> Result<u32, Box<dyn std::error::Error>> {
        let mut steps = 0;
        while pool.release_step()? {
            steps += 1;
            assert!(
                pool.count_figures_step()?,
                "the figures were dropped at release step {steps}"
            );
            pool.check_attribution()?;
            sum_rule_holds(&pool.stats()?);
            for v in written {
                scribble(pool, rng, v)?;
            }
        }
        Ok(steps)
    };

    // A delete: q's map goes leaf by leaf while p and r are written.
    pool.delete_volume("q")?;
    let before = pool.stats()?;
    assert!(!before.releasing.is_empty(), "q's map is released in steps");
    assert!(before.releasing_bytes > 0, "q alone names some chunks");
    sum_rule_holds(&before);
    let steps = release_keeping_figures(&pool, &mut rng, &["p", "r"])?;
    assert!(steps >= 16, "{steps} steps: too few to interleave");
    let after = pool.stats()?;
    assert!(after.releasing.is_empty() && after.releasing_bytes == 0);
    sum_rule_holds(&after);

    // A rollback: p's old map (leaves shared with s, others its own) is released once its
    // new one, the snapshot's, is counted.
    pool.rollback_volume("p", "s", true)?;
    while !pool.count_figures_step()? {
        scribble(&pool, &mut rng, "p")?;
    }
    assert!(release_keeping_figures(&pool, &mut rng, &["p"])? >= 2);
    // The snapshot's map, whose root p's new map shares: its release lets go of the whole
    // shared tree in one step, and the figures follow.
    pool.delete_snapshot("p", "s")?;
    assert!(
        !pool.pending_releases().is_empty(),
        "s is released in steps"
    );
    release_keeping_figures(&pool, &mut rng, &["p"])?;

    // A map still being released at the close is counted at the next open, its steps
    // interleaved with the count's.
    pool.delete_volume("r")?;
    pool.release_step()?;
    pool.close()?;
    drop(pool);
    let pool = open_stepped()?;
    assert!(!pool.pending_releases().is_empty(), "r's release resumes");
    let (mut released, mut counted) = (true, false);
    while released || !counted {
        counted = pool.count_figures_step()?;
        released = pool.release_step()?;
        scribble(&pool, &mut rng, "p")?;
    }
    pool.check_attribution()?;
    sum_rule_holds(&pool.stats()?);
    Ok(())
}

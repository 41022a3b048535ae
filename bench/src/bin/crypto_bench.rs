//! crypto-bench: what sealing and opening cost per 4 KiB object in an encrypted pool, by where
//! the object's session key comes from (docs/FORMAT.md, "Encryption"):
//!
//!   cargo run --release -p condense-bench --bin crypto-bench -- --objects 200000 --threads 2
//!
//! Rows: seal (this open's session); open an object of this session (no lock); of one other
//! session (its key cached, one slot read lock); of 512 sessions in turn (all cached); of 4096
//! sessions in turn (more than the cache holds: most opens derive the key). Each open row runs
//! on 1 thread and on --threads threads over the same objects.

use anyhow::{Context, Result};
use clap::Parser;
use condense_engine::crypto::{Crypto, Kind, NonceScheme};
use std::time::Instant;

#[derive(Parser)]
struct Args {
    /// Objects per row.
    #[arg(long, default_value_t = 200_000)]
    objects: usize,
    /// Threads for the concurrent open rows.
    #[arg(long, default_value_t = 2)]
    threads: usize,
}

const OBJECT: usize = 4096;
const KEY: [u8; 32] = [0x42; 32];
const UUID: [u8; 16] = [7; 16];

fn data(seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..OBJECT)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn session() -> Result<Crypto> {
    Ok(Crypto::reader(&KEY, UUID, NonceScheme::Session)?.start_session("bench")?)
}

/// `n` objects sealed by `sessions` sessions in turn.
fn sealed_by(sessions: usize, n: usize) -> Result<Vec<Vec<u8>>> {
    let plain = data(1);
    let mut out = vec![Vec::new(); n];
    for s in 0..sessions {
        let c = session()?;
        for o in out.iter_mut().skip(s).step_by(sessions) {
            *o = c.sealed(Kind::Chunk, b"ctx", &plain)?;
        }
    }
    Ok(out)
}

/// Open every object on `threads` threads (each opens all); returns ns per object opened.
fn open_all(c: &Crypto, objects: &[Vec<u8>], threads: usize) -> Result<f64> {
    let t = Instant::now();
    std::thread::scope(|s| -> Result<()> {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| -> Result<()> {
                    for o in objects {
                        let p = c.open(Kind::Chunk, b"ctx", o, String::new)?;
                        std::hint::black_box(p);
                    }
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join()
                .map_err(|_| anyhow::anyhow!("opener thread panicked"))??;
        }
        Ok(())
    })?;
    Ok(t.elapsed().as_nanos() as f64 / (objects.len() * threads) as f64)
}

fn row(name: &str, ns: f64) {
    println!(
        "{name:<52} {ns:>9.0} ns/object {:>8.0} MB/s per thread",
        OBJECT as f64 / ns * 1e3
    );
}

fn main() -> Result<()> {
    let a = Args::parse();
    let n = a.objects;
    println!(
        "crypto-bench: {n} objects of {OBJECT} bytes per row, AES-256-GCM (ring), {} threads",
        a.threads
    );
    let own = session()?;
    let plain = data(2);
    let t = Instant::now();
    let mine: Vec<Vec<u8>> = (0..n)
        .map(|_| own.sealed(Kind::Chunk, b"ctx", &plain))
        .collect::<Result<_, _>>()
        .context("sealing")?;
    row(
        "seal (this session)",
        t.elapsed().as_nanos() as f64 / n as f64,
    );
    let reader = Crypto::reader(&KEY, UUID, NonceScheme::Session)?;
    for (name, objects, c) in [
        ("open, this session (no lock)", mine.clone(), &own),
        (
            "open, one other session (cached key)",
            sealed_by(1, n)?,
            &reader,
        ),
        (
            "open, 512 other sessions in turn (cached keys)",
            sealed_by(512, n)?,
            &reader,
        ),
        (
            "open, 4096 other sessions in turn (cache misses)",
            sealed_by(4096, n)?,
            &reader,
        ),
    ] {
        open_all(c, &objects[..n.min(4096)], 1)?; // warm the key cache
        row(&format!("{name}, 1 thread"), open_all(c, &objects, 1)?);
        row(
            &format!("{name}, {} threads", a.threads),
            open_all(c, &objects, a.threads)?,
        );
    }
    Ok(())
}

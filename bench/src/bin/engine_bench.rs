//! engine-bench: write and read through the engine API, side by side with the same job on a
//! plain file in the same directory, and print MB/s, IOPS, RSS and RAM per unique chunk.
//!
//!   cargo run --release -p condense-bench --bin engine-bench -- --dir /work/bench --size 1G
//!
//! Jobs (each writes --size bytes in 1 MiB writes, then flushes / fsyncs inside the timing):
//!   zeros         all-zero blocks
//!   duplicate     the compressible data set again, into a second volume
//!   compressible  unique blocks that LZ4 compresses about 2:1
//!   incompressible unique random blocks
//! then sequential reads (1 MiB) and 4 KiB random reads (2 threads) of the compressible data.
//! With --cold the page cache is dropped before each read job (needs root); with --reopen the
//! pool is closed and opened again before them.

use anyhow::{Context, Result};
use clap::Parser;
use condense_engine::{Compression, InitOptions, OpenOptions, Pool, VolumeHandle, WritePolicy};
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

#[derive(Parser)]
struct Args {
    /// Directory for the pool and the plain file (the same disk for both).
    #[arg(long, default_value = "bench-tmp")]
    dir: PathBuf,
    /// Bytes per job (K/M/G suffix).
    #[arg(long, default_value = "1G")]
    size: String,
    /// Compression: lz4, zstd:N or none.
    #[arg(long, default_value = "lz4")]
    compression: String,
    /// Random 4 KiB reads per read job.
    #[arg(long, default_value_t = 200_000)]
    random_reads: u64,
    /// Drop the page cache before read jobs (root only).
    #[arg(long)]
    cold: bool,
    /// Encrypt the pool at rest (AES-256-GCM, a random key for this run).
    #[arg(long)]
    encrypt: bool,
    /// Close and reopen the pool before the read jobs, so reads meet data of an earlier open
    /// (in an encrypted pool: objects sealed by another session, opened with a derived key).
    #[arg(long)]
    reopen: bool,
    /// Run only these write jobs (zeros, compressible, duplicate, incompressible), and the
    /// read jobs only if "reads" is named too (they read the compressible job's volume).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
}

const WRITE: usize = 1 << 20;
const BS: usize = 4096;

fn parse_size(s: &str) -> Result<u64> {
    let (n, m) = match s.chars().last() {
        Some('K') => (&s[..s.len() - 1], 1u64 << 10),
        Some('M') => (&s[..s.len() - 1], 1 << 20),
        Some('G') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    Ok(n.parse::<u64>().context("size")? * m)
}

/// A small xorshift generator: fast enough that data generation does not dominate.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn fill(&mut self, b: &mut [u8]) {
        for c in b.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Zeros,
    Compressible,
    Incompressible,
}

/// The `i`th 1 MiB piece of a data set; every block is unique (a counter in its first bytes).
fn piece(kind: Kind, i: u64, base: &[u8], out: &mut [u8]) {
    match kind {
        Kind::Zeros => out.fill(0),
        Kind::Compressible | Kind::Incompressible => {
            let off = (i as usize * WRITE) % (base.len() - WRITE);
            out.copy_from_slice(&base[off..off + WRITE]);
            for (b, blk) in out.chunks_mut(BS).enumerate() {
                blk[..8].copy_from_slice(&(i * 256 + b as u64).to_le_bytes());
                blk[8..16].copy_from_slice(&(i ^ 0x5a5a_5a5a).to_le_bytes());
            }
        }
    }
}

fn base_data(kind: Kind) -> Vec<u8> {
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let mut v = vec![0u8; 64 << 20];
    match kind {
        Kind::Incompressible => rng.fill(&mut v),
        _ => {
            // Half of each block random, half a run of one byte: LZ4 about 2:1.
            for blk in v.chunks_mut(BS) {
                rng.fill(&mut blk[..BS / 2]);
                let b = rng.next() as u8;
                blk[BS / 2..].fill(b);
            }
        }
    }
    v
}

fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

fn drop_caches(cold: bool) {
    if cold {
        // SAFETY: sync() has no arguments and no memory effects.
        unsafe { libc::sync() };
        let _ = std::fs::write("/proc/sys/vm/drop_caches", "3");
    }
}

struct Row {
    job: String,
    ours_mbs: f64,
    plain_mbs: f64,
    extra: String,
}

fn write_ours(vol: &VolumeHandle, pool: &Pool, kind: Kind, size: u64, base: &[u8]) -> Result<f64> {
    let mut buf = vec![0u8; WRITE];
    let t = Instant::now();
    for i in 0..size / WRITE as u64 {
        piece(kind, i, base, &mut buf);
        vol.write_at(i * WRITE as u64, &buf, false)?;
    }
    pool.flush()?;
    Ok(size as f64 / 1e6 / t.elapsed().as_secs_f64())
}

fn write_plain(path: &Path, kind: Kind, size: u64, base: &[u8]) -> Result<f64> {
    let f = File::create(path)?;
    let mut buf = vec![0u8; WRITE];
    let t = Instant::now();
    for i in 0..size / WRITE as u64 {
        piece(kind, i, base, &mut buf);
        f.write_all_at(&buf, i * WRITE as u64)?;
    }
    f.sync_all()?;
    Ok(size as f64 / 1e6 / t.elapsed().as_secs_f64())
}

fn seq_read(size: u64, read: &dyn Fn(u64, &mut [u8]) -> Result<()>) -> Result<f64> {
    let mut buf = vec![0u8; WRITE];
    let t = Instant::now();
    for i in 0..size / WRITE as u64 {
        read(i * WRITE as u64, &mut buf)?;
    }
    Ok(size as f64 / 1e6 / t.elapsed().as_secs_f64())
}

/// 4 KiB random reads on 2 threads; returns (IOPS, p50 µs, p99 µs).
/// Reads `buf.len()` bytes at an offset.
type ReadFn = Arc<dyn Fn(u64, &mut [u8]) -> Result<()> + Send + Sync>;

fn random_read(size: u64, n: u64, read: ReadFn) -> Result<(f64, f64, f64)> {
    let blocks = size / BS as u64;
    let t = Instant::now();
    let handles: Vec<_> = (0..2u64)
        .map(|th| {
            let read = read.clone();
            std::thread::spawn(move || -> Result<Vec<u32>> {
                let mut rng = Rng(0x9e37_79b9 + th);
                let mut buf = vec![0u8; BS];
                let mut lat = Vec::with_capacity((n / 2) as usize);
                for _ in 0..n / 2 {
                    let b = rng.next() % blocks;
                    let s = Instant::now();
                    read(b * BS as u64, &mut buf)?;
                    lat.push(s.elapsed().as_nanos() as u32);
                }
                Ok(lat)
            })
        })
        .collect();
    let mut lat = Vec::new();
    for h in handles {
        lat.extend(
            h.join()
                .map_err(|_| anyhow::anyhow!("reader thread panicked"))??,
        );
    }
    let iops = lat.len() as f64 / t.elapsed().as_secs_f64();
    lat.sort_unstable();
    let p = |q: f64| {
        lat.get(((lat.len() as f64 * q) as usize).min(lat.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0) as f64
            / 1000.0
    };
    Ok((iops, p(0.5), p(0.99)))
}

fn main() -> Result<()> {
    let a = Args::parse();
    let size = parse_size(&a.size)? / WRITE as u64 * WRITE as u64;
    let compression = match a.compression.as_str() {
        "lz4" => Compression::Lz4,
        "none" => Compression::None,
        s => Compression::Zstd(s.trim_start_matches("zstd:").parse().unwrap_or(3)),
    };
    let _ = std::fs::remove_dir_all(&a.dir);
    std::fs::create_dir_all(&a.dir)?;
    let pool_dir = a.dir.join("pool");
    let plain = a.dir.join("plain.img");
    let key = if a.encrypt {
        let mut k = [0u8; 32];
        std::fs::File::open("/dev/urandom")?.read_exact(&mut k)?;
        Some(condense_engine::UserKey::key(k))
    } else {
        None
    };
    Pool::init_path(
        &pool_dir,
        &InitOptions {
            compression,
            write_policy: WritePolicy::Async,
            encryption: key.clone(),
            ..Default::default()
        },
    )?;
    let open = || {
        Pool::open_path(
            &pool_dir,
            OpenOptions {
                key: key.clone(),
                ..Default::default()
            },
        )
    };
    let mut pool = open()?;
    let rss0 = rss_bytes();
    let mut rows = Vec::new();

    let comp_base = base_data(Kind::Compressible);
    let rand_base = base_data(Kind::Incompressible);
    for (name, kind) in [
        ("zeros", Kind::Zeros),
        ("compressible", Kind::Compressible),
        ("duplicate", Kind::Compressible),
        ("incompressible", Kind::Incompressible),
    ] {
        let picked = |n: &str| a.only.is_empty() || a.only.iter().any(|o| o == n);
        if !picked(name) || (name == "duplicate" && !picked("compressible")) {
            continue;
        }
        let vol_name = format!("v-{name}");
        pool.create_volume(&vol_name, size)?;
        let vol = pool.volume(&vol_name)?;
        let base = if kind == Kind::Incompressible {
            &rand_base
        } else {
            &comp_base
        };
        let before = pool.stats()?.unique_chunks;
        let ours = write_ours(&vol, &pool, kind, size, base)?;
        let plain_mbs = write_plain(&plain, kind, size, base)?;
        let after = pool.stats()?;
        rows.push(Row {
            job: format!("write {name}"),
            ours_mbs: ours,
            plain_mbs,
            extra: format!(
                "new unique chunks {}, stored {:.1} MB",
                after.unique_chunks - before,
                after.stored_bytes as f64 / 1e6
            ),
        });
    }
    // Reads of the compressible data set.
    let reads = a.only.is_empty()
        || (a.only.iter().any(|o| o == "reads") && a.only.iter().any(|o| o == "compressible"));
    if reads {
        if a.reopen {
            pool.close()?;
            drop(pool);
            pool = open()?;
        }
        read_jobs(&a, &pool, size, &comp_base, &plain, &mut rows)?;
    }
    print_rows(&a, &pool, &rows, rss0)
}

/// Sequential and random reads of the compressible job's volume and of the plain file.
fn read_jobs(
    a: &Args,
    pool: &Pool,
    size: u64,
    comp_base: &[u8],
    plain: &Path,
    rows: &mut Vec<Row>,
) -> Result<()> {
    let _ = write_plain(plain, Kind::Compressible, size, comp_base)?;
    let vol = Arc::new(pool.volume("v-compressible")?);
    let pf = Arc::new(File::open(plain)?);
    drop_caches(a.cold);
    let v2 = vol.clone();
    let ours = seq_read(size, &move |o, b| Ok(v2.read_at(o, b)?))?;
    drop_caches(a.cold);
    let p2 = pf.clone();
    let plain_mbs = seq_read(size, &move |o, b| Ok(p2.read_exact_at(b, o)?))?;
    rows.push(Row {
        job: "sequential read 1 MiB".into(),
        ours_mbs: ours,
        plain_mbs,
        extra: String::new(),
    });
    drop_caches(a.cold);
    let v3 = vol.clone();
    let (oi, o50, o99) = random_read(
        size,
        a.random_reads,
        Arc::new(move |o, b| Ok(v3.read_at(o, b)?)),
    )?;
    drop_caches(a.cold);
    let p3 = pf.clone();
    let (pi, p50, p99) = random_read(
        size,
        a.random_reads,
        Arc::new(move |o, b| Ok(p3.read_exact_at(b, o)?)),
    )?;
    rows.push(Row {
        job: "random read 4 KiB (2 threads)".into(),
        ours_mbs: oi * BS as f64 / 1e6,
        plain_mbs: pi * BS as f64 / 1e6,
        extra: format!(
            "IOPS {oi:.0} vs {pi:.0}; p50 {o50:.1} vs {p50:.1} µs, p99 {o99:.1} vs {p99:.1} µs"
        ),
    });

    Ok(())
}

fn print_rows(a: &Args, pool: &Pool, rows: &[Row], rss0: u64) -> Result<()> {
    let st = pool.stats()?;
    println!(
        "engine-bench: {} per job, compression {}, dir {}{}",
        a.size,
        a.compression,
        a.dir.display(),
        if a.cold {
            ", cold cache"
        } else {
            ", warm cache"
        }
    );
    println!(
        "{:<32} {:>12} {:>12} {:>8}  notes",
        "job", "ours MB/s", "plain MB/s", "ratio"
    );
    for r in rows {
        println!(
            "{:<32} {:>12.0} {:>12.0} {:>8.2}  {}",
            r.job,
            r.ours_mbs,
            r.plain_mbs,
            r.ours_mbs / r.plain_mbs,
            r.extra
        );
    }
    println!(
        "unique chunks {}, RAM for index+maps {:.1} MB = {:.1} bytes per unique chunk; process RSS {:.0} MB (grew {:.0} MB; includes page-cache-free buffers)",
        st.unique_chunks,
        st.index_ram_bytes as f64 / 1e6,
        st.ram_bytes_per_unique_chunk,
        rss_bytes() as f64 / 1e6,
        (rss_bytes().saturating_sub(rss0)) as f64 / 1e6
    );
    println!(
        "physical {:.1} MB for {:.1} MB written: saving {:.1} %",
        st.physical_bytes as f64 / 1e6,
        st.written_bytes as f64 / 1e6,
        st.saving_percent
    );
    pool.close()?;
    let _ = std::fs::remove_dir_all(&a.dir);
    Ok(())
}

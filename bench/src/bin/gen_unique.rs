//! gen-unique: write N blocks of 4096 bytes to stdout, each one unique but highly compressible,
//! the same stream for the same --seed (so a second run is all duplicates of the first).
//!
//!   target/release/gen-unique --blocks 1000000 --seed 1 | condense import - --name a --size 4096000000
//!
//! Block i: bytes 0..8 = the i-th output of SplitMix64 seeded with S (little endian), bytes 8..16 =
//! i (little endian), bytes 16..4096 = a 16-byte text repeated (LZ4 makes ~55 bytes of a block).
//! No block is all zeros.
//!
//! Into a pipe the blocks go by vmsplice(2) from a 16 MiB ring of 1 MiB batches, so the generator
//! costs almost no CPU (~10 GB/s into `dd bs=1M`, against ~2.5 GB/s and a core of kernel copying
//! with write(2)). A batch is rewritten only after 15 MiB more has gone into the pipe, which holds
//! at most 1 MiB: a reader that read(2)s the pipe, or splices it on through pipes holding less than
//! 15 MiB in all, never sees a page change. A reader that keeps spliced pages longer (zero-copy to a
//! socket) needs --no-vmsplice. Into anything else (file, /dev/null), plain write(2).
//!
//! With --progress-file PATH the number of blocks written so far is kept in PATH (replaced by
//! rename, so a reader never sees a partial number), about every 1 % and at the end; bench/scale.sh
//! samples it. At the end a line with the rate goes to stderr.

use anyhow::{bail, Context, Result};
use clap::Parser;
use std::fs::File;
use std::io::{ErrorKind, Write};
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Parser)]
struct Args {
    /// Number of 4096-byte blocks to write.
    #[arg(long)]
    blocks: u64,
    /// Seed: the same seed gives the same stream, another seed a disjoint set of blocks.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Keep the number of blocks written so far in this file (about every 1 %).
    #[arg(long)]
    progress_file: Option<PathBuf>,
    /// Use write(2) even into a pipe.
    #[arg(long)]
    no_vmsplice: bool,
}

const BS: usize = 4096;
/// Blocks per write: 1 MiB.
const BATCH: usize = 256;
/// Batches in the ring: 16 MiB.
const RING: usize = 16;
/// The pipe buffer we ask for (the default maximum of /proc/sys/fs/pipe-max-size).
const PIPE_SIZE: libc::c_int = 1 << 20;
/// Repeated from byte 16 to the end of every block. A short period keeps LZ4's literals few.
const FILLER: &[u8] = b"gen-unique fill ";
const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// One page-aligned block, so that vmsplice passes whole pages.
#[derive(Clone, Copy)]
#[repr(C, align(4096))]
struct Block([u8; BS]);

/// The i-th output of SplitMix64 started at `seed`.
fn splitmix64(seed: u64, i: u64) -> u64 {
    let mut z = seed.wrapping_add(GOLDEN.wrapping_mul(i.wrapping_add(1)));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn write_progress(path: &Path, tmp: &Path, blocks: u64) -> Result<()> {
    std::fs::write(tmp, format!("{blocks}\n"))
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(tmp, path).with_context(|| format!("cannot rename to {}", path.display()))
}

/// Hand `blocks` to the pipe `out` by reference (see the module comment for when the pages may
/// be reused).
fn vmsplice_all(out: &File, blocks: &[Block]) -> std::io::Result<()> {
    let mut p = blocks.as_ptr().cast::<u8>();
    let mut left = std::mem::size_of_val(blocks);
    while left > 0 {
        let iov = libc::iovec {
            iov_base: p as *mut libc::c_void,
            iov_len: left,
        };
        // SAFETY: the iovec covers memory of `blocks`, borrowed for the call; the kernel only
        // reads it (no SPLICE_F_GIFT).
        let r = unsafe { libc::vmsplice(out.as_raw_fd(), &iov, 1, 0) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        left -= r as usize;
        // SAFETY: r <= left, so p stays inside (or one past the end of) `blocks`.
        p = unsafe { p.add(r as usize) };
    }
    Ok(())
}

fn as_bytes(blocks: &[Block]) -> &[u8] {
    // SAFETY: Block is repr(C) over [u8; BS] with size == align == BS, so a slice of blocks is
    // contiguous initialized bytes without padding.
    unsafe { std::slice::from_raw_parts(blocks.as_ptr().cast::<u8>(), size_of_val(blocks)) }
}

fn main() -> Result<()> {
    let a = Args::parse();
    if a.blocks.checked_mul(BS as u64).is_none() {
        bail!("--blocks {} is too large", a.blocks);
    }
    // Unbuffered stdout as a File: Stdout is line-buffered and would split our writes at
    // every 0x0a byte of a header.
    let mut out = File::from(
        std::io::stdout()
            .as_fd()
            .try_clone_to_owned()
            .context("stdout")?,
    );
    // SAFETY: fcntl on a descriptor we own, integer arguments only. Both fail (-1) when stdout
    // is not a pipe; a refused size leaves the pipe smaller, which is fine.
    let is_pipe = unsafe {
        libc::fcntl(out.as_raw_fd(), libc::F_SETPIPE_SZ, PIPE_SIZE);
        libc::fcntl(out.as_raw_fd(), libc::F_GETPIPE_SZ)
    };
    let splice = is_pipe > 0 && (is_pipe as usize) <= BS * BATCH && !a.no_vmsplice;

    let mut filled = Block([0; BS]);
    for (d, s) in filled.0[16..].iter_mut().zip(FILLER.iter().cycle()) {
        *d = *s;
    }
    let mut ring = vec![filled; RING * BATCH];

    let tmp = a.progress_file.as_ref().map(|p| {
        let mut t = p.clone().into_os_string();
        t.push(".tmp");
        PathBuf::from(t)
    });
    let report_every = (a.blocks / 100).max(1);
    let mut next_report = report_every;
    if let (Some(p), Some(t)) = (&a.progress_file, &tmp) {
        write_progress(p, t, 0)?;
    }

    let started = Instant::now();
    let mut done = 0u64;
    let mut slot = 0;
    while done < a.blocks {
        let n = (a.blocks - done).min(BATCH as u64) as usize;
        let batch = &mut ring[slot * BATCH..slot * BATCH + n];
        slot = (slot + 1) % RING;
        for (k, block) in batch.iter_mut().enumerate() {
            let i = done + k as u64;
            block.0[..8].copy_from_slice(&splitmix64(a.seed, i).to_le_bytes());
            block.0[8..16].copy_from_slice(&i.to_le_bytes());
        }
        let r = if splice {
            vmsplice_all(&out, batch)
        } else {
            out.write_all(as_bytes(batch))
        };
        if let Err(e) = r {
            if e.kind() == ErrorKind::BrokenPipe {
                // Expected when the reader is killed (bench/scale.sh pass 3): one line, no
                // backtrace.
                eprintln!(
                    "gen-unique: output closed by the reader after {done} of {} blocks",
                    a.blocks
                );
                std::process::exit(1);
            }
            return Err(e).context("writing stdout");
        }
        done += n as u64;
        if let (Some(p), Some(t)) = (&a.progress_file, &tmp) {
            if done >= next_report || done == a.blocks {
                write_progress(p, t, done)?;
                next_report = done + report_every;
            }
        }
    }
    let s = started.elapsed().as_secs_f64();
    let bytes = a.blocks * BS as u64;
    eprintln!(
        "gen-unique: {} blocks ({:.2} GiB, seed {}) in {:.2} s, {:.0} MB/s{}",
        a.blocks,
        bytes as f64 / (1u64 << 30) as f64,
        a.seed,
        s,
        bytes as f64 / 1e6 / s.max(1e-9),
        if splice { " (vmsplice)" } else { "" }
    );
    Ok(())
}

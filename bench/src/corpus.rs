//! The corpus as the compression benchmarks see it (`dictionary-bench`, `similarity-bench`):
//! the unique non-zero 4 KiB blocks of raw disk images, in first-write order.

use anyhow::{bail, Context, Result};
use condense_engine::reduction::{fingerprint, is_zero};
use std::collections::HashSet;
use std::fs::File;
use std::io::Read;
use std::os::fd::AsRawFd;

pub const BLOCK: usize = 4096;

/// The unique non-zero blocks of every image, in first-write order.
pub fn unique_blocks(images: &[String]) -> Result<Vec<u8>> {
    let key = [0u8; 32];
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    let mut buf = vec![0u8; 1 << 24];
    for path in images {
        let mut f = File::open(path).with_context(|| format!("opening {path}"))?;
        for (start, end) in data_extents(&f)? {
            let mut pos = start - start % BLOCK as u64;
            while pos < end {
                let want = ((end - pos) as usize).min(buf.len());
                let want = want.div_ceil(BLOCK) * BLOCK;
                let n = read_at(&mut f, pos, &mut buf[..want])?;
                if n == 0 {
                    break;
                }
                for b in buf[..n - n % BLOCK].chunks_exact(BLOCK) {
                    if !is_zero(b) && seen.insert(fingerprint(&key, b)) {
                        out.extend_from_slice(b);
                    }
                }
                pos += n as u64;
            }
        }
        eprintln!("{path}: {} unique blocks so far", out.len() / BLOCK);
    }
    Ok(out)
}

fn read_at(f: &mut File, pos: u64, buf: &mut [u8]) -> Result<usize> {
    use std::io::{Seek, SeekFrom};
    f.seek(SeekFrom::Start(pos))?;
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// (start, end) of each data extent of `f` (SEEK_DATA / SEEK_HOLE), or the whole file where
/// the filesystem cannot tell.
fn data_extents(f: &File) -> Result<Vec<(u64, u64)>> {
    let size = f.metadata()?.len();
    let fd = f.as_raw_fd();
    let mut out = Vec::new();
    let mut off = 0i64;
    while (off as u64) < size {
        // SAFETY: lseek on an open descriptor we own; it only moves the file offset.
        let data = unsafe { libc::lseek(fd, off, libc::SEEK_DATA) };
        if data < 0 {
            break; // ENXIO: no data past `off`
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        if hole < 0 {
            out.push((data as u64, size));
            break;
        }
        out.push((data as u64, hole as u64));
        off = hole;
    }
    Ok(out)
}

/// [`unique_blocks`] of the images named on a bench's command line (none is an error), with a
/// line saying how many there are and how long reading them took.
pub fn unique_blocks_announced(images: &[String]) -> Result<Vec<u8>> {
    if images.is_empty() {
        bail!("name the raw images to read (e.g. /work/corpus/images/*.raw)");
    }
    let t0 = std::time::Instant::now();
    let blocks = unique_blocks(images)?;
    println!(
        "{} images: {} unique non-zero 4 KiB blocks ({:.3} GB) read in {:.0} s",
        images.len(),
        blocks.len() / BLOCK,
        blocks.len() as f64 / 1e9,
        t0.elapsed().as_secs_f64()
    );
    Ok(blocks)
}

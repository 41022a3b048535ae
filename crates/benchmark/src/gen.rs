//! A generated set of VM-like disk images for `condense bench` when no images are given.
//!
//! Each image is laid out like a small server's disk, 4 KiB block by block:
//!
//! | share | content |
//! |---|---|
//! | 0–35 % | the "OS install": the same in every image, except ~3 % of blocks changed per image |
//! | 35–55 % | data of this image only (logs, databases: text-like, compressible; and binaries) |
//! | 55–65 % | a copy of part of the 35–55 % region (a file copied inside the guest) |
//! | 65–75 % | zeros written explicitly (a preallocated, zeroed file) |
//! | 75–100 % | never written: a hole in the sparse image file |
//!
//! Content blocks are 60 % text-like (compresses ~2–3:1 with LZ4) and 40 % random (already
//! compressed files). Everything is derived from fixed seeds, so a run is repeatable.

use crate::error::{Context, Result};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

pub const BLOCK: usize = 4096;
const BASE_DOMAIN: u64 = 0xC0DE_BA5E;

/// What one block of a generated image holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Block {
    /// Content made from this seed (equal seeds give equal blocks).
    Data(u64),
    Zero,
    Hole,
}

/// splitmix64: a tiny, fast, well-mixed generator (enough for test data).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

fn mix(a: u64, b: u64) -> u64 {
    Rng::new(a.wrapping_mul(0x1000_0000_01B3) ^ b).next_u64()
}

/// The kind of block `b` of image `image` (of `blocks` blocks).
pub fn layout(image: u64, b: u64, blocks: u64) -> Block {
    let at = |pct: u64| blocks * pct / 100;
    let (base_end, uniq_end, dup_end, zero_end) = (at(35), at(55), at(65), at(75));
    if b < base_end {
        if mix(image + 1, b) % 100 < 3 {
            Block::Data(mix(image + 1, b))
        } else {
            Block::Data(mix(BASE_DOMAIN, b))
        }
    } else if b < uniq_end {
        Block::Data(mix(image + 1, b))
    } else if b < dup_end {
        let span = (uniq_end - base_end).max(1);
        Block::Data(mix(image + 1, base_end + (b - uniq_end) % span))
    } else if b < zero_end {
        Block::Zero
    } else {
        Block::Hole
    }
}

const WORDS: &[&[u8]] = &[
    b"the",
    b"server",
    b"request",
    b"GET",
    b"/index.html",
    b"200",
    b"user",
    b"session",
    b"error",
    b"connection",
    b"from",
    b"port",
    b"kernel:",
    b"INFO",
    b"WARN",
    b"debug",
    b"cache",
    b"database",
    b"query",
    b"SELECT",
    b"FROM",
    b"WHERE",
    b"id",
    b"name",
    b"value",
    b"config",
    b"service",
    b"started",
    b"stopped",
    b"timeout",
    b"127.0.0.1",
    b"10.0.0.",
    b"HTTP/1.1",
    b"Mozilla/5.0",
    b"systemd[1]:",
    b"CRON",
    b"sshd",
    b"Accepted",
    b"for",
    b"root",
    b"bytes",
    b"ms",
    b"/var/lib/",
    b"nginx",
    b"postfix/smtpd",
    b"dhcpd:",
    b"named",
];

/// Fill `buf` with the content of a data block made from `seed`.
pub fn fill(seed: u64, buf: &mut [u8]) {
    let mut rng = Rng::new(seed);
    if seed % 10 < 6 {
        // Text-like: words, numbers, spaces and newlines, like logs and config files.
        let mut i = 0;
        let mut words = 0u32;
        while i < buf.len() {
            let r = rng.next_u64();
            let word: Vec<u8> = if r.is_multiple_of(8) {
                ((r >> 8) % 1_000_000).to_string().into_bytes()
            } else {
                let idx = ((r >> 8) % WORDS.len() as u64) as usize;
                WORDS.get(idx).copied().unwrap_or(b"x").to_vec()
            };
            for &c in word.iter().chain(std::iter::once(&b' ')) {
                if let Some(slot) = buf.get_mut(i) {
                    *slot = c;
                    i += 1;
                }
            }
            words += 1;
            if words.is_multiple_of(12) {
                if let Some(slot) = buf.get_mut(i.saturating_sub(1)) {
                    *slot = b'\n';
                }
            }
        }
    } else {
        for chunk in buf.chunks_mut(8) {
            let v = rng.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

/// Write `count` images of `size` bytes (rounded down to whole MiB) into `dir`.
pub fn generate(dir: &Path, count: usize, size: u64) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let size = (size >> 20).max(1) << 20;
    let blocks = size / BLOCK as u64;
    let mut out = Vec::new();
    let mut buf = vec![0u8; 1 << 20];
    for i in 0..count {
        let path = dir.join(format!("vm{}.raw", i + 1));
        let f = File::create(&path)
            .with_context(|| format!("cannot create image {}", path.display()))?;
        f.set_len(size)
            .with_context(|| format!("cannot size image {}", path.display()))?;
        let per_buf = (buf.len() / BLOCK) as u64;
        let mut b = 0u64;
        while b < blocks {
            let n = per_buf.min(blocks - b);
            let mut any = false;
            for (j, blk) in buf.chunks_mut(BLOCK).take(n as usize).enumerate() {
                match layout(i as u64, b + j as u64, blocks) {
                    Block::Data(seed) => {
                        fill(seed, blk);
                        any = true;
                    }
                    Block::Zero => {
                        blk.fill(0);
                        any = true;
                    }
                    Block::Hole => blk.fill(0),
                }
            }
            if any {
                let len = n as usize * BLOCK;
                f.write_all_at(&buf[..len], b * BLOCK as u64)
                    .with_context(|| format!("cannot write image {}", path.display()))?;
            }
            b += n;
        }
        f.sync_all()
            .with_context(|| format!("cannot sync image {}", path.display()))?;
        out.push(path);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn images_share_the_base_duplicate_inside_and_have_zeros_and_holes() {
        let blocks = 1000;
        let kinds: Vec<Vec<Block>> = (0..3)
            .map(|i| (0..blocks).map(|b| layout(i, b, blocks)).collect())
            .collect();
        // Base region mostly shared between images.
        let shared = (0..350)
            .filter(|&b| kinds[0][b as usize] == kinds[1][b as usize])
            .count();
        assert!(shared > 300 && shared < 350, "shared {shared}");
        // Unique region differs between images.
        assert!((350..550).all(|b| kinds[0][b] != kinds[1][b]));
        // Duplicate region repeats the unique region of the same image.
        let uniq: HashSet<Block> = kinds[0][350..550].iter().copied().collect();
        assert!(kinds[0][550..650].iter().all(|k| uniq.contains(k)));
        assert!(kinds[0][650..750].iter().all(|k| *k == Block::Zero));
        assert!(kinds[0][750..].iter().all(|k| *k == Block::Hole));
    }

    #[test]
    fn content_is_deterministic_and_text_blocks_compress() {
        let mut a = vec![0u8; BLOCK];
        let mut b = vec![0u8; BLOCK];
        fill(42, &mut a);
        fill(42, &mut b);
        assert_eq!(a, b);
        fill(43, &mut b);
        assert_ne!(a, b);
        // seed % 10 < 6 gives text: only printable bytes, few distinct values.
        fill(10, &mut a);
        assert!(a.iter().all(|&c| c == b'\n' || (32..127).contains(&c)));
        assert!(a.iter().collect::<HashSet<_>>().len() < 80);
    }

    #[test]
    fn generate_writes_sparse_images_of_the_asked_size() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let imgs = generate(dir.path(), 2, 4 << 20)?;
        assert_eq!(imgs.len(), 2);
        for p in &imgs {
            assert_eq!(std::fs::metadata(p)?.len(), 4 << 20);
        }
        let a = std::fs::read(&imgs[0])?;
        let b = std::fs::read(&imgs[1])?;
        assert_ne!(a, b);
        assert!(a[(4 << 20) * 3 / 4..].iter().all(|&c| c == 0));
        Ok(())
    }
}

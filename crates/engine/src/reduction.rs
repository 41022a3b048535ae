//! Data reduction of one block: zero detection, fingerprinting, compression.
//!
//! Pure functions of bytes, shared by the write path and by `condense estimate`, so that an
//! estimate projects exactly what the engine stores. A compressed chunk is kept only when it
//! saves at least 1/8 of the block; otherwise it is stored raw.

use crate::error::{Error, Result};
use crate::format::{ChunkCodec, Compression, Fingerprint};

/// True if every byte is zero. ORs 64-byte runs (which the compiler vectorises) and stops at
/// the first non-zero run.
pub fn is_zero(block: &[u8]) -> bool {
    let runs = block.chunks_exact(64);
    let tail = runs.remainder();
    runs.into_iter()
        .all(|c| c.iter().fold(0u8, |a, &b| a | b) == 0)
        && tail.iter().all(|&b| b == 0)
}

/// Keyed BLAKE3-256 of a block, truncated to the 128 bits the pool keeps.
pub fn fingerprint(key: &[u8; 32], block: &[u8]) -> Fingerprint {
    let h = blake3::keyed_hash(key, block);
    let mut fp = [0u8; 16];
    fp.copy_from_slice(&h.as_bytes()[..16]);
    fp
}

/// Compress one block under the pool's setting; returns the codec actually used and the bytes
/// to store (raw when compression would save less than 1/8).
pub fn compress(compression: Compression, block: &[u8]) -> (ChunkCodec, Vec<u8>) {
    try_compress(compression, block).unwrap_or_else(|| (ChunkCodec::Raw, block.to_vec()))
}

/// The compressed form of one block, if it saves at least 1/8 (else the block is stored raw:
/// callers then use the block itself, with no copy).
pub fn try_compress(compression: Compression, block: &[u8]) -> Option<(ChunkCodec, Vec<u8>)> {
    let limit = block.len() - block.len() / 8;
    let attempt = match compression {
        Compression::None => None,
        Compression::Lz4 => lz4_into_scratch(block, limit).map(|c| (ChunkCodec::Lz4, c)),
        Compression::Zstd(level) => zstd::bulk::compress(block, i32::from(level))
            .ok()
            .map(|c| (ChunkCodec::Zstd, c)),
    };
    attempt.filter(|(_, c)| c.len() <= limit)
}

thread_local! {
    /// LZ4's worst-case output buffer, kept per thread: `lz4_flex::block::compress` allocates
    /// and zeroes a fresh one for every block, which cost as much as a fifth of the LZ4 time.
    static LZ4_SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// LZ4 of `block`, if it fits in `limit` bytes (only those bytes are copied out).
fn lz4_into_scratch(block: &[u8], limit: usize) -> Option<Vec<u8>> {
    LZ4_SCRATCH.with(|scratch| {
        let mut out = scratch.borrow_mut();
        let need = lz4_flex::block::get_maximum_output_size(block.len());
        if out.len() < need {
            out.resize(need, 0);
        }
        match lz4_flex::block::compress_into(block, &mut out) {
            Ok(n) if n <= limit => Some(out[..n].to_vec()),
            _ => None,
        }
    })
}

/// Decode a stored payload into `out` (exactly one block).
pub fn decompress(
    codec: ChunkCodec,
    payload: &[u8],
    out: &mut [u8],
    what: impl Fn() -> String,
) -> Result<()> {
    let n = match codec {
        ChunkCodec::Raw => {
            if payload.len() != out.len() {
                return Err(Error::corrupt(what(), "raw chunk of the wrong length"));
            }
            out.copy_from_slice(payload);
            out.len()
        }
        ChunkCodec::Lz4 => lz4_flex::block::decompress_into(payload, out)
            .map_err(|e| Error::corrupt(what(), format!("lz4: {e}")))?,
        ChunkCodec::Zstd => zstd::bulk::decompress_to_buffer(payload, out)
            .map_err(|e| Error::corrupt(what(), format!("zstd: {e}")))?,
    };
    if n != out.len() {
        return Err(Error::corrupt(
            what(),
            format!("decompressed to {n} bytes, expected {}", out.len()),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_detection() {
        let mut b = vec![0u8; 4096];
        assert!(is_zero(&b));
        b[4095] = 1;
        assert!(!is_zero(&b));
        b[4095] = 0;
        b[17] = 1;
        assert!(!is_zero(&b));
    }

    #[test]
    fn compress_round_trip_and_raw_fallback() -> Result<()> {
        let text: Vec<u8> = (0..4096u32)
            .map(|i| b"condense "[(i % 9) as usize])
            .collect();
        for c in [Compression::Lz4, Compression::Zstd(3), Compression::None] {
            let (codec, stored) = compress(c, &text);
            let mut out = vec![0u8; 4096];
            decompress(codec, &stored, &mut out, || "test".into())?;
            assert_eq!(out, text);
            if c != Compression::None {
                assert!(stored.len() < 4096 / 2);
            }
        }
        let mut rng = crate::sim::SimRng::new(1);
        let noise: Vec<u8> = (0..4096).map(|_| rng.next_u64() as u8).collect();
        assert_eq!(compress(Compression::Lz4, &noise).0, ChunkCodec::Raw);
        Ok(())
    }
}

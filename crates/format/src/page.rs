//! Metadata pages in `meta.dat`: its 64-byte header, the 16-byte pointers of interior pages
//! ([`Ptr`]) and the stored form of a page (stride-delta, then LZ4 or zstd, padded to whole
//! units); docs/FORMAT.md "Metadata pages".
//!
//! Invariants: a page is trusted only when its stored bytes match its pointer's CRC (checked
//! by the page cache); [`decode_page`] returns `None`, never panics, for stored bytes that do
//! not decode to exactly one page.

use super::common::{
    check_crc, check_magic, check_version, crc, put_u32, Reader, FORMAT_VERSION, META_MAGIC,
};
use crate::error::{Error, Result};

/// The header of `meta.dat` (page 0).
pub fn encode_meta_header(uuid: &[u8; 16]) -> Vec<u8> {
    let mut b = Vec::with_capacity(4096);
    b.extend_from_slice(&META_MAGIC);
    put_u32(&mut b, FORMAT_VERSION);
    put_u32(&mut b, 4096);
    b.extend_from_slice(uuid);
    b.resize(60, 0);
    let c = crc(&[&b]);
    put_u32(&mut b, c);
    b.resize(4096, 0);
    b
}

pub fn decode_meta_header(buf: &[u8], uuid: &[u8; 16]) -> Result<()> {
    const WHAT: &str = "meta.dat header";
    if buf.len() < 64 {
        return Err(Error::corrupt(WHAT, "truncated"));
    }
    let mut r = Reader::new(buf, WHAT);
    check_magic(r.bytes(8)?, &META_MAGIC, WHAT)?;
    check_version(r.u32()?, WHAT)?;
    let page = r.u32()?;
    let found: [u8; 16] = r.array()?;
    let stored = u32::from_le_bytes([buf[60], buf[61], buf[62], buf[63]]);
    check_crc(stored, crc(&[&buf[..60]]), WHAT)?;
    if page != 4096 || &found != uuid {
        return Err(Error::corrupt(
            WHAT,
            "another pool's metadata, or another page size",
        ));
    }
    Ok(())
}

/// Bytes of a metadata page.
pub const PAGE_BYTES: usize = 4096;
/// Bytes of a pointer in an interior page.
pub const PTR_BYTES: usize = 16;

/// The allocation unit of `meta.dat`: stored pages take whole units.
pub const UNIT: usize = 64;

/// A pointer to a stored page: its first 64-byte unit in `meta.dat` (0 = none), the
/// units its run takes, how it is encoded, and the CRC-32C of the stored units.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ptr {
    pub page: u64,
    pub crc: u32,
    pub units: u16,
    /// 0: the page as is (64 units); 1: stride-delta + LZ4; 2: stride-delta + zstd level 1
    /// (see [`encode_page`]).
    pub codec: u8,
}

impl Ptr {
    pub const NULL: Ptr = Ptr {
        page: 0,
        crc: 0,
        units: 0,
        codec: 0,
    };

    pub fn read(buf: &[u8], i: usize) -> Ptr {
        let at = i * PTR_BYTES;
        let mut p = [0u8; 8];
        p.copy_from_slice(&buf[at..at + 8]);
        let mut c = [0u8; 4];
        c.copy_from_slice(&buf[at + 8..at + 12]);
        Ptr {
            page: u64::from_le_bytes(p),
            crc: u32::from_le_bytes(c),
            units: u16::from_le_bytes([buf[at + 12], buf[at + 13]]),
            codec: buf[at + 14],
        }
    }

    pub fn write(self, buf: &mut [u8], i: usize) {
        let at = i * PTR_BYTES;
        buf[at..at + 8].copy_from_slice(&self.page.to_le_bytes());
        buf[at + 8..at + 12].copy_from_slice(&self.crc.to_le_bytes());
        buf[at + 12..at + 14].copy_from_slice(&self.units.to_le_bytes());
        buf[at + 14] = self.codec;
        buf[at + 15] = 0;
    }
}

/// How a page is stored: each 8-byte word minus the word `stride` before it (sequential
/// chunk ids, runs of equal entries and similar records become runs of equal words), then
/// LZ4 or zstd (whichever is smaller), behind a 2-byte length, padded to whole 64-byte
/// units. Falls back to the raw page when that does not save a unit. Returns (codec, stored
/// bytes).
pub fn encode_page(data: &[u8], stride: usize) -> (u8, Vec<u8>) {
    let word = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&data[i * 8..i * 8 + 8]);
        u64::from_le_bytes(b)
    };
    let words = PAGE_BYTES / 8;
    let mut t = Vec::with_capacity(PAGE_BYTES);
    for i in 0..words {
        let v = if i >= stride {
            word(i).wrapping_sub(word(i - stride))
        } else {
            word(i)
        };
        t.extend_from_slice(&v.to_le_bytes());
    }
    // Both codecs, keep the smaller: LZ4 wins on long runs (sequential maps), zstd on mixed
    // pages (maps with duplicates, chunk records).
    let lz4 = lz4_flex::block::compress(&t);
    let z = ZSTD.with(|z| match z.borrow_mut().as_mut() {
        Some((c, _)) => c.compress(&t),
        None => zstd::bulk::compress(&t, 1),
    });
    let (codec, c) = match z {
        Ok(z) if z.len() < lz4.len() => (2u8, z),
        _ => (1u8, lz4),
    };
    let stored = 2 + c.len();
    if stored.div_ceil(UNIT) >= PAGE_BYTES / UNIT {
        return (0, data.to_vec());
    }
    let mut out = Vec::with_capacity(stored.div_ceil(UNIT) * UNIT);
    out.extend_from_slice(&(c.len() as u16).to_le_bytes());
    out.extend_from_slice(&c);
    out.resize(stored.div_ceil(UNIT) * UNIT, 0);
    (codec, out)
}

type ZstdContexts = (
    zstd::bulk::Compressor<'static>,
    zstd::bulk::Decompressor<'static>,
);

thread_local! {
    /// zstd contexts of this thread, reused for every page: creating one per page cost more
    /// than compressing the page. `None` if they could not be made (then one per call).
    static ZSTD: std::cell::RefCell<Option<ZstdContexts>> = std::cell::RefCell::new(
        zstd::bulk::Compressor::new(1)
            .ok()
            .zip(zstd::bulk::Decompressor::new().ok()),
    );
}

/// The page back from its stored bytes; `None` if they do not decode.
pub fn decode_page(codec: u8, stored: &[u8], stride: usize) -> Option<Box<[u8]>> {
    match codec {
        0 => (stored.len() == PAGE_BYTES).then(|| stored.to_vec().into_boxed_slice()),
        1 | 2 => {
            let len = usize::from(u16::from_le_bytes([*stored.first()?, *stored.get(1)?]));
            let c = stored.get(2..2 + len)?;
            let t = if codec == 1 {
                let mut t = vec![0u8; PAGE_BYTES];
                if lz4_flex::block::decompress_into(c, &mut t).ok()? != PAGE_BYTES {
                    return None;
                }
                t
            } else {
                let mut t = vec![0u8; PAGE_BYTES];
                let n = ZSTD.with(|z| match z.borrow_mut().as_mut() {
                    Some((_, d)) => d.decompress_to_buffer(c, &mut t[..]).ok(),
                    None => zstd::bulk::decompress_to_buffer(c, &mut t[..]).ok(),
                })?;
                if n != PAGE_BYTES {
                    return None;
                }
                t
            };
            let mut out = vec![0u8; PAGE_BYTES].into_boxed_slice();
            for i in 0..PAGE_BYTES / 8 {
                let mut b = [0u8; 8];
                b.copy_from_slice(&t[i * 8..i * 8 + 8]);
                let mut v = u64::from_le_bytes(b);
                if i >= stride {
                    let mut p = [0u8; 8];
                    p.copy_from_slice(&out[(i - stride) * 8..(i - stride) * 8 + 8]);
                    v = v.wrapping_add(u64::from_le_bytes(p));
                }
                out[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
            }
            Some(out)
        }
        _ => None,
    }
}

/// The associated data of a sealed page: where it is (its first unit in `meta.dat`) and what
/// it is (chunk table or block map, level). Not the tree: a shared page serves several.
pub fn page_ctx(page: u64, chunk_table: bool, level: u8) -> [u8; 10] {
    let mut c = [0u8; 10];
    c[..8].copy_from_slice(&page.to_le_bytes());
    c[8] = u8::from(chunk_table);
    c[9] = level;
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pointers_round_trip() {
        let mut page = vec![0u8; PAGE_BYTES];
        let p = Ptr {
            page: 1 << 40,
            crc: 0xdead_beef,
            units: 17,
            codec: 2,
        };
        p.write(&mut page, 255);
        assert_eq!(Ptr::read(&page, 255), p);
        assert_eq!(Ptr::read(&page, 0), Ptr::NULL);
    }

    #[test]
    fn pages_round_trip_and_damage_is_none() {
        let mut page = vec![0u8; PAGE_BYTES];
        for (i, w) in page.chunks_exact_mut(8).enumerate() {
            w.copy_from_slice(&(1000 + i as u64).to_le_bytes());
        }
        for stride in [1, 2, 4] {
            let (codec, stored) = encode_page(&page, stride);
            assert_ne!(codec, 0, "sequential words compress");
            assert_eq!(stored.len() % UNIT, 0);
            assert_eq!(
                decode_page(codec, &stored, stride).as_deref(),
                Some(&page[..])
            );
            // Cut inside the compressed bytes (the rest of the last unit is padding).
            let len = usize::from(u16::from_le_bytes([stored[0], stored[1]]));
            for cut in [0, 1, 2, 2 + len / 2, 2 + len - 1] {
                assert!(
                    decode_page(codec, &stored[..cut], stride).is_none(),
                    "cut {cut}"
                );
            }
            assert!(decode_page(7, &stored, stride).is_none(), "unknown codec");
        }
        let noise: Vec<u8> = (0..PAGE_BYTES as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        let (codec, stored) = encode_page(&noise, 1);
        assert_eq!(decode_page(codec, &stored, 1).as_deref(), Some(&noise[..]));
        assert!(
            decode_page(0, &stored[..100], 1).is_none(),
            "a raw page of 100 bytes"
        );
    }

    #[test]
    fn meta_header_round_trips_and_refuses_damage() -> Result<()> {
        let uuid = [3; 16];
        let h = encode_meta_header(&uuid);
        decode_meta_header(&h, &uuid)?;
        assert!(decode_meta_header(&h, &[4; 16]).is_err(), "another pool");
        for cut in [0, 8, 63] {
            assert!(decode_meta_header(&h[..cut], &uuid).is_err(), "cut {cut}");
        }
        let mut bad = h.clone();
        bad[20] ^= 1;
        assert!(decode_meta_header(&bad, &uuid).is_err(), "CRC");
        Ok(())
    }
}

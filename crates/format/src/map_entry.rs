//! Block-map entries: the 8-byte slots of a block-map leaf, 512 to a page: `0` UNMAPPED,
//! `1` ZERO, `id + 2` a chunk, `u64::MAX` LOST. In memory (and in journal records) an entry
//! is a chunk id or [`ENTRY_ZERO`], [`ENTRY_UNMAPPED`], [`ENTRY_LOST`].
//! docs/FORMAT.md "Metadata pages".
//!
//! Invariants: every raw value decodes (a damaged value past [`CHUNK_ID_LIMIT`] is a chunk
//! id that does not exist, for `verify` to name); a zeroed leaf is all UNMAPPED.

use super::common::{CHUNK_ID_LIMIT, ENTRY_LOST, ENTRY_UNMAPPED, ENTRY_ZERO};

/// The entry a raw slot value stands for.
pub fn decode(raw: u64) -> u64 {
    match raw {
        0 => ENTRY_UNMAPPED,
        1 => ENTRY_ZERO,
        id => id - 2,
    }
}

/// The raw slot value of an entry.
pub fn encode(entry: u64) -> u64 {
    match entry {
        ENTRY_UNMAPPED => 0,
        ENTRY_ZERO => 1,
        id => id + 2,
    }
}

/// The chunk a raw slot names: every value but UNMAPPED, ZERO and LOST (a damaged value past
/// [`CHUNK_ID_LIMIT`] is passed on, for `verify` to name as a chunk that does not exist).
pub fn raw_chunk(raw: u64) -> Option<u64> {
    (raw >= 2 && raw != encode(ENTRY_LOST)).then(|| raw - 2)
}

const _: () = assert!(ENTRY_LOST >= CHUNK_ID_LIMIT && ENTRY_ZERO >= CHUNK_ID_LIMIT);

/// The raw value of slot `i` of a block-map leaf.
pub fn slot(leaf: &[u8], i: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&leaf[i * 8..i * 8 + 8]);
    u64::from_le_bytes(b)
}

/// Set slot `i` of a block-map leaf to `entry`.
pub fn write_slot(leaf: &mut [u8], i: usize, entry: u64) {
    leaf[i * 8..i * 8 + 8].copy_from_slice(&encode(entry).to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip() {
        let mut leaf = vec![0u8; 512 * 8];
        assert_eq!(
            decode(slot(&leaf, 3)),
            ENTRY_UNMAPPED,
            "a zeroed leaf is unmapped"
        );
        let entries = [
            0,
            1,
            77,
            CHUNK_ID_LIMIT - 1,
            ENTRY_ZERO,
            ENTRY_UNMAPPED,
            ENTRY_LOST,
        ];
        for (i, &e) in entries.iter().enumerate() {
            write_slot(&mut leaf, i, e);
        }
        for (i, &e) in entries.iter().enumerate() {
            assert_eq!(decode(slot(&leaf, i)), e);
        }
        assert_eq!(raw_chunk(encode(77)), Some(77));
        assert_eq!(raw_chunk(encode(ENTRY_LOST)), None);
        assert_eq!(raw_chunk(encode(ENTRY_ZERO)), None);
    }

    #[test]
    fn damaged_raw_values_decode_without_panicking() {
        for raw in [2, CHUNK_ID_LIMIT + 2, u64::MAX - 1, u64::MAX] {
            let e = decode(raw);
            assert_eq!(encode(e), raw);
        }
    }
}

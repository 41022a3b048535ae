//! The fuzz targets' checks on a bounded number of seeded random inputs, so that CI exercises
//! them on stable Rust without cargo-fuzz. Inputs are random bytes and mutations of valid
//! messages (valid prefixes reach deeper states than pure noise).

use condense_nbd::fuzz;
use condense_nbd::proto::*;
use rand::{Rng, SeedableRng};

fn mutate(rng: &mut rand::rngs::StdRng, mut v: Vec<u8>) -> Vec<u8> {
    for _ in 0..rng.random_range(0..4) {
        if v.is_empty() {
            break;
        }
        let i = rng.random_range(0..v.len());
        match rng.random_range(0..3) {
            0 => v[i] = rng.random(),
            1 => v.truncate(i),
            _ => v.insert(i, rng.random()),
        }
    }
    v
}

fn request(rng: &mut rand::rngs::StdRng) -> Vec<u8> {
    let mut r = REQUEST_MAGIC.to_be_bytes().to_vec();
    r.extend_from_slice(&rng.random_range(0u16..32).to_be_bytes());
    r.extend_from_slice(&rng.random_range(0u16..9).to_be_bytes());
    r.extend_from_slice(&rng.random::<u64>().to_be_bytes());
    r.extend_from_slice(&rng.random_range(0u64..(1 << 20) + 100).to_be_bytes());
    let len = rng.random_range(0u32..70_000);
    r.extend_from_slice(&len.to_be_bytes());
    if u16::from_be_bytes([r[6], r[7]]) == CMD_WRITE {
        r.extend((0..len).map(|_| rng.random::<u8>()));
    }
    r
}

#[test]
fn parsers_never_panic_on_random_input() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x6e6264);
    for _ in 0..30_000 {
        let n = rng.random_range(0..200);
        let mut v: Vec<u8> = (0..n).map(|_| rng.random()).collect();
        if rng.random_bool(0.3) && v.len() > 10 {
            // Make option payloads look like GO/META requests: small length prefixes.
            v[5..9].copy_from_slice(&rng.random_range(0u32..8).to_be_bytes());
        }
        fuzz::parsers(&v);
    }
}

#[test]
fn a_valid_session_reaches_transmission() {
    // Handshake prefix with structured replies, then a 4 KiB read: greeting (18) + replies to
    // STRUCTURED_REPLY, SET_META_CONTEXT, GO, then a hole chunk for the unwritten block.
    let mut v = vec![3u8];
    v.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
    v.extend_from_slice(&[0, 0, 0, 0]);
    v.extend_from_slice(&7u64.to_be_bytes());
    v.extend_from_slice(&0u64.to_be_bytes());
    v.extend_from_slice(&4096u32.to_be_bytes());
    let handshake_only = fuzz::session(&[3u8]);
    assert!(handshake_only > 18, "{handshake_only}");
    assert_eq!(fuzz::session(&v), handshake_only + 20 + 12);
}

#[test]
fn a_valid_session_with_a_dirty_bitmap_gets_two_block_status_chunks() {
    // Selector bit 2 selects qemu:dirty-bitmap:s beside base:allocation: BLOCK_STATUS of one
    // block is answered by two chunks of one descriptor each (20 + 4 + 8 bytes).
    let mut v = vec![7u8];
    v.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
    v.extend_from_slice(&0u16.to_be_bytes());
    v.extend_from_slice(&CMD_BLOCK_STATUS.to_be_bytes());
    v.extend_from_slice(&7u64.to_be_bytes());
    v.extend_from_slice(&0u64.to_be_bytes());
    v.extend_from_slice(&4096u32.to_be_bytes());
    let handshake_only = fuzz::session(&[7u8]);
    assert!(
        handshake_only > fuzz::session(&[3u8]),
        "two contexts selected"
    );
    assert_eq!(fuzz::session(&v), handshake_only + 2 * 32);
}

#[test]
fn sessions_never_panic_and_always_end() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5e55);
    for i in 0..300 {
        let mut v = vec![rng.random::<u8>() | if i % 4 == 0 { 0 } else { 3 }];
        for _ in 0..rng.random_range(0..12) {
            let r = request(&mut rng);
            v.extend(mutate(&mut rng, r));
        }
        let _ = fuzz::session(&v);
    }
    // Pure noise from the first byte of the handshake on.
    for _ in 0..100 {
        let n = rng.random_range(0..300);
        let v: Vec<u8> = (0..n).map(|_| rng.random()).collect();
        let _ = fuzz::session(&v);
    }
}

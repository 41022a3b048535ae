//! The similarity sketch of a block (issue 44, delta compression): 12 Odess-style features,
//! each its own super-feature ("12x1" in bench/README.md "similarity deltas").
//!
//! Owns: the one definition of a block's super-features, a pure function of its bytes, so the
//! write path, `estimate` and the bench agree. Feature `i` is the maximum over sampled
//! positions of `MUL[i]·h + ADD[i]`, where `h` is a gear rolling hash over the last 32 bytes
//! and a position is sampled where `h`'s top [`SAMPLE_BITS`] bits are zero; super-feature `i`
//! is feature `i` hashed with its index. Invariants: the tables are fixed (seeded constants,
//! never change in a pool's life: the sketch index is rebuilt from nothing at open, so a
//! change would only cost hits, never correctness); a block with no sampled position has no
//! sketch (it is neither looked up nor indexed).

/// Features (and super-features) per block.
pub const FEATURES: usize = 12;
/// A position is sampled when the top this many bits of its rolling hash are zero.
pub const SAMPLE_BITS: u32 = 5;
/// Bits the gear hash shifts a byte: its window is 64 / 2 = 32 bytes.
const SHIFT: u32 = 2;

/// splitmix64, at compile time: the gear table and transforms from a fixed seed.
const fn splitmix(s: u64) -> (u64, u64) {
    let s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = s;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (s, z ^ (z >> 31))
}

/// The gear table (256 values) then the multipliers (odd) and addends of the 12 transforms,
/// drawn in that order from seed 26 (the bench's).
const TABLES: ([u64; 256], [u64; FEATURES], [u64; FEATURES]) = {
    let mut s = 26u64;
    let mut gear = [0u64; 256];
    let mut i = 0;
    while i < 256 {
        let (n, v) = splitmix(s);
        s = n;
        gear[i] = v;
        i += 1;
    }
    let mut mul = [0u64; FEATURES];
    let mut i = 0;
    while i < FEATURES {
        let (n, v) = splitmix(s);
        s = n;
        mul[i] = v | 1;
        i += 1;
    }
    let mut add = [0u64; FEATURES];
    let mut i = 0;
    while i < FEATURES {
        let (n, v) = splitmix(s);
        s = n;
        add[i] = v;
        i += 1;
    }
    (gear, mul, add)
};

/// A 64-bit finalizer (murmur3's): features into super-features.
fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    x ^= x >> 33;
    x = x.wrapping_mul(0xC4CE_B9FE_1A85_EC53);
    x ^ (x >> 33)
}

/// The super-features of `block`, or `None` if no position was sampled.
pub fn super_features(block: &[u8]) -> Option<[u64; FEATURES]> {
    let (gear, mul, add) = &TABLES;
    let threshold = u64::MAX >> SAMPLE_BITS;
    let mut f = [0u64; FEATURES];
    let mut h = 0u64;
    let mut sampled = false;
    for &b in block {
        h = (h << SHIFT).wrapping_add(gear[usize::from(b)]);
        if h <= threshold {
            sampled = true;
            for ((f, m), a) in f.iter_mut().zip(mul).zip(add) {
                *f = (*f).max(m.wrapping_mul(h).wrapping_add(*a));
            }
        }
    }
    if !sampled {
        return None;
    }
    for (i, f) in f.iter_mut().enumerate() {
        *f = mix((i as u64 + 1) ^ *f);
    }
    Some(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn noise(seed: u64, n: usize) -> Vec<u8> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                let (ns, v) = splitmix(s);
                s = ns;
                v as u8
            })
            .collect()
    }

    #[test]
    fn similar_blocks_share_super_features_and_unrelated_ones_do_not() {
        let a = noise(1, 4096);
        let mut b = a.clone();
        b[100..140].copy_from_slice(&noise(2, 40));
        let c = noise(3, 4096);
        let (sa, sb, sc) = (
            super_features(&a).expect("sampled"),
            super_features(&b).expect("sampled"),
            super_features(&c).expect("sampled"),
        );
        let shared = |x: &[u64; FEATURES], y: &[u64; FEATURES]| {
            x.iter().zip(y).filter(|(p, q)| p == q).count()
        };
        assert!(shared(&sa, &sb) >= 6, "{}", shared(&sa, &sb));
        assert_eq!(shared(&sa, &sc), 0);
        assert_eq!(super_features(&a), Some(sa), "a pure function");
    }
}

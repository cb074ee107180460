//! Deterministic block content: the bytes of segment `s` of layer `l` of the block with hash
//! id `h` are a counter-based pseudo-random stream seeded by `(h, l, s)`. Any byte of any
//! segment can be recomputed independently, so a load is checked byte for byte without
//! keeping a copy, and a block landing in the wrong place (wrong hash, layer, segment or
//! offset) differs from what is expected.
//!
//! The generator is a per-word mix of `seed + i`, so words are independent (no dependency
//! chain): filling and checking run at several GB/s per core.

const K1: u64 = 0x9E37_79B9_7F4A_7C15;
const K2: u64 = 0xBF58_476D_1CE4_E5B9;
const K3: u64 = 0x94D0_49BB_1331_11EB;

#[inline(always)]
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(K2);
    z = (z ^ (z >> 27)).wrapping_mul(K3);
    z ^ (z >> 31)
}

/// The stream seed of segment `seg` of layer `layer` of block `hash`.
pub fn seed(hash: u64, layer: u32, seg: u32) -> u64 {
    mix(mix(hash ^ K1).wrapping_add(((layer as u64) << 8 | seg as u64).wrapping_mul(K1)))
}

/// Word `i` of the stream `seed`.
#[inline(always)]
fn word(seed: u64, i: u64) -> u64 {
    // One multiply-xorshift round on a Weyl sequence: cheap and independent per word.
    let z = seed.wrapping_add(i.wrapping_mul(K1));
    let z = (z ^ (z >> 29)).wrapping_mul(K3);
    z ^ (z >> 32)
}

/// Fills `dst` with the stream `seed` (byte `j` of `dst` is byte `j` of the stream).
pub fn fill(dst: &mut [u8], seed: u64) {
    let mut chunks = dst.chunks_exact_mut(8);
    let mut i = 0u64;
    for c in &mut chunks {
        c.copy_from_slice(&word(seed, i).to_le_bytes());
        i += 1;
    }
    let rest = chunks.into_remainder();
    if !rest.is_empty() {
        let w = word(seed, i).to_le_bytes();
        let n = rest.len();
        rest.copy_from_slice(&w[..n]);
    }
}

/// Checks that `src` holds the stream `seed`; returns the offset of the first wrong byte.
pub fn verify(src: &[u8], seed: u64) -> Option<usize> {
    const RUN: usize = 64;
    let mut chunks = src.chunks_exact(8 * RUN);
    let mut i = 0u64;
    for run in &mut chunks {
        // Branch-free over a run of words; locate the byte only on a mismatch.
        let mut diff = 0u64;
        for (k, c) in run.chunks_exact(8).enumerate() {
            let got = u64::from_le_bytes(c.try_into().expect("8-byte chunk"));
            diff |= got ^ word(seed, i + k as u64);
        }
        if diff != 0 {
            let base = (i as usize) * 8;
            return first_diff(&src[base..base + 8 * RUN], seed, i).map(|o| base + o);
        }
        i += RUN as u64;
    }
    let rest = chunks.remainder();
    let base = (i as usize) * 8;
    first_diff(rest, seed, i).map(|o| base + o)
}

/// First wrong byte of `src`, which should hold the stream from word `first_word` on.
fn first_diff(src: &[u8], seed: u64, first_word: u64) -> Option<usize> {
    for (k, c) in src.chunks(8).enumerate() {
        let w = word(seed, first_word + k as u64).to_le_bytes();
        if let Some(j) = c.iter().zip(&w).position(|(a, b)| a != b) {
            return Some(k * 8 + j);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_then_verify_and_catch_every_flip() {
        for len in [0usize, 1, 7, 8, 9, 511, 512, 513, 4096, 8192 + 3] {
            let s = seed(42, 3, 1);
            let mut b = vec![0u8; len];
            fill(&mut b, s);
            assert_eq!(verify(&b, s), None, "len {len}");
            for pos in [0, len / 2, len.saturating_sub(1)] {
                if pos < len {
                    b[pos] ^= 0x10;
                    assert_eq!(verify(&b, s), Some(pos), "len {len} pos {pos}");
                    b[pos] ^= 0x10;
                }
            }
        }
    }

    #[test]
    fn streams_differ_by_hash_layer_and_segment() {
        let mut a = vec![0u8; 256];
        fill(&mut a, seed(1, 0, 0));
        for s in [seed(2, 0, 0), seed(1, 1, 0), seed(1, 0, 1)] {
            assert!(verify(&a, s).is_some());
        }
        // A shifted stream does not verify either.
        let mut b = vec![0u8; 264];
        fill(&mut b, seed(1, 0, 0));
        assert!(verify(&b[8..], seed(1, 0, 0)).is_some());
    }
}

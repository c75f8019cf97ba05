//! Shared helpers for the integration tests: a tiny deterministic PRNG and
//! chunking utilities (no extra dependencies).
#![allow(dead_code)]

pub mod calls;
pub mod parse;
pub mod stop_check;

pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
}

/// Splits `s` into pieces of `n` characters.
pub fn chunks_of(s: &str, n: usize) -> Vec<String> {
    let cs: Vec<char> = s.chars().collect();
    cs.chunks(n).map(|c| c.iter().collect()).collect()
}

/// Splits `s` at random character boundaries.
pub fn random_chunks(s: &str, rng: &mut Rng) -> Vec<String> {
    let cs: Vec<char> = s.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < cs.len() {
        let n = 1 + rng.below(6);
        let j = (i + n).min(cs.len());
        out.push(cs[i..j].iter().collect());
        i = j;
    }
    out
}

/// A random string over an alphabet of fragments.
pub fn random_text(rng: &mut Rng, alphabet: &[&str], max_parts: usize) -> String {
    let n = rng.below(max_parts + 1);
    (0..n).map(|_| *rng.pick(alphabet)).collect()
}

//! Chained 128-bit block hashes (xxh3-128).
//!
//! ```text
//!   root ── seed (reproducible) or 128 random bits per process
//!   h[0] = xxh3_128( root   | salt tag | salt | tokens[0 .. B]     )
//!   h[i] = xxh3_128( h[i-1] |                   tokens[i*B .. i*B+B] )
//! ```
//! Only full blocks get a hash. Token ids are hashed as 4-byte little-endian
//! words. A zero digest is remapped to 1 so that `BlockHash` can be non-zero
//! (the pool stores `Option<BlockHash>` in 16 bytes).

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::num::NonZeroU128;

use xxhash_rust::xxh3::{xxh3_128, xxh3_128_with_seed};

/// The identity of one full block of tokens and everything before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(NonZeroU128);

impl BlockHash {
    /// The raw 128-bit value (never zero).
    pub fn get(self) -> u128 {
        self.0.get()
    }

    /// A hash from its raw value; `None` for zero, which no block hash takes.
    pub fn from_raw(v: u128) -> Option<Self> {
        NonZeroU128::new(v).map(BlockHash)
    }

    fn from_digest(v: u128) -> Self {
        // A zero digest has probability 2^-128; remapping it keeps the niche.
        BlockHash(NonZeroU128::new(v).unwrap_or(NonZeroU128::MIN))
    }
}

/// Computes the chained hashes of a token sequence from a fixed root.
///
/// ```
/// use cairn_kv::ChainHasher;
/// let h = ChainHasher::from_seed(7);
/// let a = h.hash_blocks(&[1, 2, 3, 4, 5], 2, None);
/// assert_eq!(a.len(), 2); // the partial third block has no hash
/// let b = h.hash_blocks(&[1, 2, 3, 4], 2, Some(b"tenant-a"));
/// assert_ne!(a[0], b[0]); // the salt changes the whole chain
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChainHasher {
    root: u128,
}

impl ChainHasher {
    /// A hasher with an explicit root value.
    pub fn with_root(root: u128) -> Self {
        ChainHasher { root }
    }

    /// A reproducible hasher: the same seed gives the same hashes everywhere.
    pub fn from_seed(seed: u64) -> Self {
        ChainHasher {
            root: xxh3_128_with_seed(b"cairn-kv/root/v1", seed),
        }
    }

    /// A hasher whose root is random for this process, so hashes cannot be
    /// predicted (or collided on purpose) from outside.
    pub fn random() -> Self {
        // RandomState is keyed from the OS random source once per process.
        let s = RandomState::new();
        let hi = s.hash_one(0x6361_6972_6e5f_6869_u64) as u128;
        let lo = s.hash_one(0x6361_6972_6e5f_6c6f_u64) as u128;
        ChainHasher {
            root: (hi << 64) | lo,
        }
    }

    /// The root value (hashes from different roots never mix).
    pub fn root(&self) -> u128 {
        self.root
    }

    /// Hashes of every full block of `tokens` (`tokens.len() / block_size` of
    /// them); `salt` goes into the first block only, so it changes the chain.
    ///
    /// `block_size` must be at least 1.
    pub fn hash_blocks(
        &self,
        tokens: &[u32],
        block_size: usize,
        salt: Option<&[u8]>,
    ) -> Vec<BlockHash> {
        assert!(block_size > 0, "block_size must be at least 1");
        let n = tokens.len() / block_size;
        let mut out = Vec::with_capacity(n);
        if n == 0 {
            return out;
        }
        let mut parent = self.root;
        // Block 0: root | salt tag (| salt length | salt) | tokens. The tag and
        // length prefix keep "no salt", "empty salt" and salts that look like
        // token bytes apart.
        let mut first = Vec::with_capacity(16 + 9 + salt.map_or(0, <[u8]>::len) + 4 * block_size);
        first.extend_from_slice(&parent.to_le_bytes());
        match salt {
            None => first.push(0),
            Some(s) => {
                first.push(1);
                first.extend_from_slice(&(s.len() as u64).to_le_bytes());
                first.extend_from_slice(s);
            }
        }
        for t in &tokens[..block_size] {
            first.extend_from_slice(&t.to_le_bytes());
        }
        let h = BlockHash::from_digest(xxh3_128(&first));
        parent = h.get();
        out.push(h);
        self.chain(
            parent,
            &tokens[block_size..n * block_size],
            block_size,
            &mut out,
        );
        out
    }

    /// Continues a chain: the hashes of the full blocks of `tokens`, which
    /// follow the block whose hash is `parent` (the salt is already in it).
    ///
    /// ```
    /// use cairn_kv::ChainHasher;
    /// let h = ChainHasher::from_seed(1);
    /// let all = h.hash_blocks(&[1, 2, 3, 4, 5, 6], 2, Some(b"s"));
    /// let head = h.hash_blocks(&[1, 2], 2, Some(b"s"));
    /// assert_eq!(h.extend(head[0], &[3, 4, 5, 6], 2), all[1..]);
    /// ```
    pub fn extend(&self, parent: BlockHash, tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
        assert!(block_size > 0, "block_size must be at least 1");
        let n = tokens.len() / block_size;
        let mut out = Vec::with_capacity(n);
        self.chain(
            parent.get(),
            &tokens[..n * block_size],
            block_size,
            &mut out,
        );
        out
    }

    /// Blocks after the first: parent | tokens, written in place into one buffer.
    fn chain(&self, mut parent: u128, tokens: &[u32], block_size: usize, out: &mut Vec<BlockHash>) {
        let mut buf = vec![0u8; 16 + 4 * block_size];
        for block in tokens.chunks_exact(block_size) {
            buf[..16].copy_from_slice(&parent.to_le_bytes());
            for (dst, t) in buf[16..].chunks_exact_mut(4).zip(block) {
                dst.copy_from_slice(&t.to_le_bytes());
            }
            let h = BlockHash::from_digest(xxh3_128(&buf));
            parent = h.get();
            out.push(h);
        }
    }
}

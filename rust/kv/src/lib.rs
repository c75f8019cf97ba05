//! cairn-kv: the bookkeeping of paged KV memory (docs/design.md §3). Pure Rust.
//!
//! [`BlockPool`] hands out fixed-size block ids with refcounts and keeps an
//! O(1) LRU free list; its prefix table maps [`BlockHash`]es (chained
//! xxh3-128 over token ids, from [`ChainHasher`]) to the blocks that hold that
//! content, so two prompts with a common prefix share physical blocks.
//!
//! ```
//! use cairn_kv::{BlockPool, ChainHasher};
//! let mut pool = BlockPool::new(64, 4).unwrap();
//! let hasher = ChainHasher::from_seed(0);
//! let prompt: Vec<u32> = (0..10).collect();          // 2 full blocks + 2 tokens
//! let hashes = hasher.hash_blocks(&prompt, 4, None);
//! assert!(pool.lookup(&hashes, prompt.len()).is_empty());
//! let blocks = pool.allocate(3).unwrap();
//! pool.insert(&hashes, &blocks).unwrap();             // registers 2 blocks
//! pool.free(&blocks).unwrap();
//! let hit = pool.lookup(&hashes, prompt.len());       // revived from the free list
//! assert_eq!(hit, blocks[..2]);
//! ```

mod error;
mod hash;
mod pool;
mod prefix;

pub use error::KvError;
pub use hash::{BlockHash, ChainHasher};
pub use pool::{BlockId, BlockPool, Stats, MAX_BLOCKS, MAX_BLOCK_SIZE};

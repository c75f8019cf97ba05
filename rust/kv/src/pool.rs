//! The block allocator: refcounts, an O(1) intrusive LRU free list, and the
//! table of cached block hashes that lives alongside it.
//!
//! ```text
//!   free list (head = evicted next)          in use (refcount > 0)
//!   head ─► [7] ⇄ [3] ⇄ [9] ◄─ tail           [1] [2] [4] ...
//!            │h    │-    │h
//!            ▼           ▼
//!   table:  hash ─► block id   (cached blocks, free or in use)
//! ```
//! A block that drops to refcount 0 is appended at the tail and keeps its
//! hash, so `lookup` can still revive it. `allocate` pops from the head and
//! evicts the popped block's hash from the table at that moment.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::error::KvError;
use crate::hash::BlockHash;

/// A block index into the KV pools. Block 0 is the reserved null block.
pub type BlockId = u32;

/// Largest accepted pool (ids must fit in u32 with room for the list sentinel,
/// and the bookkeeping stays under a gigabyte).
pub const MAX_BLOCKS: usize = 1 << 24;
/// Largest accepted block size in tokens.
pub const MAX_BLOCK_SIZE: usize = 1 << 16;

const NIL: u32 = u32::MAX;

/// Counters and gauges reported by [`BlockPool::stats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Usable blocks (`num_blocks - 1`: block 0 is reserved).
    pub blocks_total: usize,
    /// Blocks on the free list (refcount 0), cached or not.
    pub blocks_free: usize,
    /// Blocks with at least one reference.
    pub blocks_in_use: usize,
    /// Blocks registered in the prefix table (free or in use).
    pub blocks_cached: usize,
    /// Number of `lookup` calls.
    pub lookups: u64,
    /// Prompt tokens served from cached blocks.
    pub hit_tokens: u64,
    /// Prompt tokens that had to be computed.
    pub miss_tokens: u64,
    /// Cached hashes dropped because their block was re-allocated.
    pub evictions: u64,
}

// Keys are already uniformly distributed 128-bit digests: use their low bits.
#[derive(Default)]
pub(crate) struct DigestHasher(u64);

impl Hasher for DigestHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u128(&mut self, v: u128) {
        self.0 = v as u64;
    }
}

pub(crate) type Table = HashMap<BlockHash, BlockId, BuildHasherDefault<DigestHasher>>;

/// Fixed-size KV block allocator with a content-addressed prefix table.
///
/// ```
/// use cairn_kv::BlockPool;
/// let mut pool = BlockPool::new(5, 16).unwrap();   // blocks 1..=4 usable
/// let a = pool.allocate(3).unwrap();
/// assert_eq!(a, vec![1, 2, 3]);
/// assert!(pool.allocate(2).is_none());            // shortfall is a value
/// pool.free(&a).unwrap();
/// assert_eq!(pool.num_free(), 4);
/// ```
#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    pub(crate) refcnt: Vec<u32>,
    pub(crate) hash: Vec<Option<BlockHash>>,
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    num_free: usize,
    // Epoch stamps for duplicate detection in `insert`, without allocating.
    pub(crate) mark: Vec<u32>,
    pub(crate) epoch: u32,
    pub(crate) table: Table,
    pub(crate) stats: Stats,
}

fn try_vec<T: Clone>(n: usize, v: T) -> Result<Vec<T>, KvError> {
    let mut out = Vec::new();
    out.try_reserve_exact(n).map_err(|_| {
        KvError::InvalidConfig(format!("cannot allocate bookkeeping for {n} blocks"))
    })?;
    out.resize(n, v);
    Ok(out)
}

impl BlockPool {
    /// A pool of `num_blocks` blocks (ids `0..num_blocks`, block 0 reserved)
    /// of `block_size` tokens each.
    pub fn new(num_blocks: usize, block_size: usize) -> Result<Self, KvError> {
        if !(2..=MAX_BLOCKS).contains(&num_blocks) {
            return Err(KvError::InvalidConfig(format!(
                "num_blocks must be between 2 and {MAX_BLOCKS} (block 0 is reserved), got {num_blocks}"
            )));
        }
        if !(1..=MAX_BLOCK_SIZE).contains(&block_size) {
            return Err(KvError::InvalidConfig(format!(
                "block_size must be between 1 and {MAX_BLOCK_SIZE}, got {block_size}"
            )));
        }
        let mut pool = BlockPool {
            block_size,
            refcnt: try_vec(num_blocks, 0)?,
            hash: try_vec(num_blocks, None)?,
            prev: try_vec(num_blocks, NIL)?,
            next: try_vec(num_blocks, NIL)?,
            head: NIL,
            tail: NIL,
            num_free: 0,
            mark: try_vec(num_blocks, 0)?,
            epoch: 0,
            table: Table::default(),
            stats: Stats::default(),
        };
        for id in 1..num_blocks as u32 {
            pool.push_tail(id);
        }
        pool.stats.blocks_total = num_blocks - 1;
        Ok(pool)
    }

    /// Total block ids, including the reserved block 0.
    pub fn num_blocks(&self) -> usize {
        self.refcnt.len()
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks on the free list (allocatable now, cached or not).
    pub fn num_free(&self) -> usize {
        self.num_free
    }

    /// Current references on `id`; block 0 always reports 0.
    pub fn refcount(&self, id: BlockId) -> Result<u32, KvError> {
        self.refcnt
            .get(id as usize)
            .copied()
            .ok_or(KvError::UnknownBlock(u64::from(id)))
    }

    /// The hash `id` is registered under, if it is cached.
    pub fn block_hash(&self, id: BlockId) -> Result<Option<BlockHash>, KvError> {
        self.hash
            .get(id as usize)
            .copied()
            .ok_or(KvError::UnknownBlock(u64::from(id)))
    }

    /// The cached block holding `h`, if any.
    pub fn cached_block(&self, h: BlockHash) -> Option<BlockId> {
        self.table.get(&h).copied()
    }

    /// Takes `n` blocks with refcount 1, least recently freed first, or
    /// `None` (nothing changed) when fewer than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.num_free {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.head;
            debug_assert_ne!(id, NIL);
            self.unlink(id);
            if let Some(h) = self.hash[id as usize].take() {
                let removed = self.table.remove(&h);
                assert_eq!(
                    removed,
                    Some(id),
                    "prefix table out of sync with block {id}"
                );
                self.stats.evictions += 1;
            }
            self.refcnt[id as usize] = 1;
            out.push(id);
        }
        Some(out)
    }

    /// Drops one reference from each block in `ids`.
    ///
    /// Blocks reaching refcount 0 are appended to the free list in REVERSE
    /// order of `ids`, so for a sequence's block table the end of the chain is
    /// evicted first. An unknown id, block 0, or more frees than references
    /// is an error and leaves the pool unchanged.
    pub fn free(&mut self, ids: &[BlockId]) -> Result<(), KvError> {
        for &id in ids {
            if id == 0 || id as usize >= self.refcnt.len() {
                return Err(KvError::UnknownBlock(u64::from(id)));
            }
        }
        for (k, &id) in ids.iter().enumerate().rev() {
            let rc = &mut self.refcnt[id as usize];
            if *rc == 0 {
                // Undo the part already applied: ids[k+1..] in reverse.
                self.undo_free(&ids[k + 1..]);
                return Err(KvError::NotReferenced(id));
            }
            *rc -= 1;
            if *rc == 0 {
                self.push_tail(id);
            }
        }
        Ok(())
    }

    fn undo_free(&mut self, applied: &[BlockId]) {
        // `applied` was processed last-to-first; restore first-to-last.
        for &id in applied {
            if self.refcnt[id as usize] == 0 {
                self.unlink(id);
            }
            self.refcnt[id as usize] += 1;
        }
    }

    /// Takes one more reference on `id`, reviving it from the free list.
    /// Returns false (nothing changed) if its refcount is saturated.
    pub(crate) fn take_ref(&mut self, id: BlockId) -> bool {
        let rc = self.refcnt[id as usize];
        if rc == u32::MAX {
            return false;
        }
        if rc == 0 {
            self.unlink(id);
        }
        self.refcnt[id as usize] = rc + 1;
        true
    }

    /// Block ids on the free list in eviction order (head first). O(free).
    pub fn free_list(&self) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.num_free);
        let mut id = self.head;
        while id != NIL {
            out.push(id);
            id = self.next[id as usize];
        }
        out
    }

    /// Current gauges and counters.
    pub fn stats(&self) -> Stats {
        Stats {
            blocks_free: self.num_free,
            blocks_in_use: self.stats.blocks_total - self.num_free,
            blocks_cached: self.table.len(),
            ..self.stats
        }
    }

    fn push_tail(&mut self, id: BlockId) {
        let i = id as usize;
        debug_assert!(self.prev[i] == NIL && self.next[i] == NIL && self.head != id);
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = id;
        } else {
            self.next[self.tail as usize] = id;
        }
        self.tail = id;
        self.num_free += 1;
    }

    fn unlink(&mut self, id: BlockId) {
        let i = id as usize;
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            assert_eq!(self.head, id, "block {id} is not on the free list");
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.num_free -= 1;
    }

    /// Checks every internal invariant; `Err` describes the first broken one.
    /// O(num_blocks): for tests and fuzzing.
    pub fn check_invariants(&self) -> Result<(), String> {
        if self.refcnt[0] != 0
            || self.hash[0].is_some()
            || self.prev[0] != NIL
            || self.next[0] != NIL
            || self.head == 0
        {
            return Err("block 0 was touched".into());
        }
        let list = self.free_list();
        if list.len() != self.num_free {
            return Err(format!(
                "free list has {} blocks, counter says {}",
                list.len(),
                self.num_free
            ));
        }
        let mut prev = NIL;
        for &id in &list {
            if self.refcnt[id as usize] != 0 {
                return Err(format!(
                    "block {id} is free but has refcount {}",
                    self.refcnt[id as usize]
                ));
            }
            if self.prev[id as usize] != prev {
                return Err(format!("broken back link at block {id}"));
            }
            prev = id;
        }
        if self.tail != prev {
            return Err("tail does not end the free list".into());
        }
        let zero = self.refcnt[1..].iter().filter(|&&r| r == 0).count();
        if zero != self.num_free {
            return Err(format!(
                "{zero} blocks have refcount 0 but {} are on the free list",
                self.num_free
            ));
        }
        let mut hashed = 0;
        for (id, h) in self.hash.iter().enumerate() {
            if let Some(h) = h {
                hashed += 1;
                if self.table.get(h) != Some(&(id as u32)) {
                    return Err(format!(
                        "block {id} carries a hash the table does not map to it"
                    ));
                }
            }
        }
        if hashed != self.table.len() {
            return Err(format!(
                "table has {} entries, blocks carry {hashed} hashes",
                self.table.len()
            ));
        }
        Ok(())
    }
}

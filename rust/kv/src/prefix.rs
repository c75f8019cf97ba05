//! Prefix-cache operations on the pool: `lookup` and `insert`.

use std::collections::hash_map::Entry;

use crate::error::KvError;
use crate::hash::BlockHash;
use crate::pool::{BlockId, BlockPool};

impl BlockPool {
    /// The longest run of cached blocks at the start of a prompt, with a
    /// reference taken on each (free blocks are revived off the free list).
    ///
    /// `hashes` are the prompt's full-block hashes, `num_tokens` its length.
    /// At most `(num_tokens - 1) / block_size` blocks are returned, so at
    /// least one prompt token is always left to compute.
    ///
    /// ```text
    ///   num_tokens = 48, block_size = 16:  [b0][b1][b2]   -> at most b0, b1
    ///   num_tokens = 49:                   [b0][b1][b2][.] -> up to b0, b1, b2
    /// ```
    pub fn lookup(&mut self, hashes: &[BlockHash], num_tokens: usize) -> Vec<BlockId> {
        let limit = (num_tokens.saturating_sub(1) / self.block_size()).min(hashes.len());
        let mut out = Vec::new();
        for h in &hashes[..limit] {
            let Some(&id) = self.table.get(h) else { break };
            if !self.take_ref(id) {
                break;
            }
            out.push(id);
        }
        let hit = (out.len() * self.block_size()) as u64;
        self.stats.lookups += 1;
        self.stats.hit_tokens += hit;
        self.stats.miss_tokens += num_tokens as u64 - hit;
        out
    }

    /// Registers `blocks[i]` as holding the content described by `hashes[i]`
    /// for every full block; returns how many new entries were made.
    ///
    /// `blocks` may be longer than `hashes` (a partial last block is never
    /// registered). A hash that is already cached keeps its block: the new
    /// block stays uncached, so inserting twice is harmless. The caller must
    /// hold a reference on every block it registers.
    pub fn insert(&mut self, hashes: &[BlockHash], blocks: &[BlockId]) -> Result<usize, KvError> {
        if blocks.len() < hashes.len() {
            return Err(KvError::TooFewBlocks {
                needed: hashes.len(),
                given: blocks.len(),
            });
        }
        let blocks = &blocks[..hashes.len()];
        self.epoch = self.epoch.wrapping_add(1);
        if self.epoch == 0 {
            self.mark.fill(0);
            self.epoch = 1;
        }
        for (h, &id) in hashes.iter().zip(blocks) {
            let i = id as usize;
            if id == 0 || i >= self.refcnt.len() {
                return Err(KvError::UnknownBlock(u64::from(id)));
            }
            if self.refcnt[i] == 0 {
                return Err(KvError::InsertFreeBlock(id));
            }
            if self.mark[i] == self.epoch {
                return Err(KvError::DuplicateBlock(id));
            }
            self.mark[i] = self.epoch;
            if matches!(self.hash[i], Some(old) if old != *h) {
                return Err(KvError::ConflictingHash(id));
            }
        }
        let mut added = 0;
        for (h, &id) in hashes.iter().zip(blocks) {
            let i = id as usize;
            if self.hash[i].is_some() {
                continue;
            }
            if let Entry::Vacant(slot) = self.table.entry(*h) {
                slot.insert(id);
                self.hash[i] = Some(*h);
                added += 1;
            }
        }
        Ok(added)
    }
}

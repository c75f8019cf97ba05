//! Errors for caller mistakes. Running out of blocks is not an error (it is
//! `None` from `allocate`); broken internal invariants are bugs and assert.

use std::fmt;

/// A request the pool refuses; the pool is unchanged when one is returned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvError {
    /// Bad pool or block size.
    InvalidConfig(String),
    /// An id outside `1..num_blocks` (block 0 is reserved).
    UnknownBlock(u64),
    /// `free` of a block that holds no (more) references.
    NotReferenced(u32),
    /// `insert` of a block nobody holds a reference on.
    InsertFreeBlock(u32),
    /// `insert` got fewer block ids than the sequence has full blocks.
    TooFewBlocks { needed: usize, given: usize },
    /// `insert` listed the same block for two positions.
    DuplicateBlock(u32),
    /// `insert` would register a block under a second, different hash.
    ConflictingHash(u32),
}

impl fmt::Display for KvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KvError::InvalidConfig(m) => f.write_str(m),
            KvError::UnknownBlock(id) => {
                write!(
                    f,
                    "block id {id} is not a usable block of this pool (block 0 is reserved)"
                )
            }
            KvError::NotReferenced(id) => write!(f, "block {id} has no reference left to free"),
            KvError::InsertFreeBlock(id) => {
                write!(
                    f,
                    "block {id} is free; insert needs blocks the caller holds"
                )
            }
            KvError::TooFewBlocks { needed, given } => write!(
                f,
                "the tokens fill {needed} blocks but only {given} block ids were given"
            ),
            KvError::DuplicateBlock(id) => write!(f, "block {id} is listed twice"),
            KvError::ConflictingHash(id) => {
                write!(f, "block {id} is already cached with different content")
            }
        }
    }
}

impl std::error::Error for KvError {}

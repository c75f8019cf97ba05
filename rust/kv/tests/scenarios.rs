//! Scenario tests with exact block ids and free-list order.

use cairn_kv::{BlockHash, BlockPool, ChainHasher, KvError};

const BS: usize = 4;

fn setup(num_blocks: usize) -> (BlockPool, ChainHasher) {
    (
        BlockPool::new(num_blocks, BS).unwrap(),
        ChainHasher::from_seed(42),
    )
}

fn toks(range: std::ops::Range<u32>) -> Vec<u32> {
    range.collect()
}

/// Allocates, registers and returns the blocks for a fresh prompt.
fn prefill(pool: &mut BlockPool, h: &ChainHasher, prompt: &[u32]) -> Vec<u32> {
    let hashes = h.hash_blocks(prompt, BS, None);
    let mut blocks = pool.lookup(&hashes, prompt.len());
    let need = prompt.len().div_ceil(BS) - blocks.len();
    blocks.extend(pool.allocate(need).unwrap());
    pool.insert(&hashes, &blocks).unwrap();
    blocks
}

#[test]
fn fresh_pool_hands_out_ids_in_order_and_never_block_zero() {
    let (mut pool, _) = setup(6);
    assert_eq!(pool.num_free(), 5);
    assert_eq!(pool.allocate(2), Some(vec![1, 2]));
    assert_eq!(pool.allocate(4), None, "no partial allocation");
    assert_eq!(pool.num_free(), 3);
    assert_eq!(pool.allocate(3), Some(vec![3, 4, 5]));
    assert_eq!(pool.allocate(1), None);
    assert_eq!(pool.allocate(0), Some(vec![]));
    pool.check_invariants().unwrap();
}

#[test]
fn two_prompts_sharing_a_prefix_share_blocks() {
    let (mut pool, h) = setup(16);
    let a: Vec<u32> = toks(0..10); // blocks [0..4) [4..8) + partial
    let a_blocks = prefill(&mut pool, &h, &a);
    assert_eq!(a_blocks, vec![1, 2, 3]);
    assert_eq!(
        pool.stats().blocks_cached,
        2,
        "partial block not registered"
    );

    let mut b = toks(0..8);
    b.extend([100, 101, 102, 103, 104]);
    let hb = h.hash_blocks(&b, BS, None);
    let hit = pool.lookup(&hb, b.len());
    assert_eq!(hit, vec![1, 2]);
    assert_eq!(pool.refcount(1), Ok(2));
    assert_eq!(pool.refcount(3), Ok(1));

    // A different salt shares nothing.
    let hs = h.hash_blocks(&b, BS, Some(b"other-tenant"));
    assert!(pool.lookup(&hs, b.len()).is_empty());
    let s = pool.stats();
    assert_eq!(
        (s.lookups, s.hit_tokens, s.miss_tokens),
        (3, 8, 10 + 5 + 13)
    );
    pool.check_invariants().unwrap();
}

#[test]
fn lookup_stops_one_block_short_of_a_fully_cached_prompt() {
    let (mut pool, h) = setup(16);
    let p = toks(0..12); // exactly 3 full blocks
    let blocks = prefill(&mut pool, &h, &p);
    assert_eq!(blocks, vec![1, 2, 3]);
    let hp = h.hash_blocks(&p, BS, None);
    assert_eq!(pool.lookup(&hp, 12), vec![1, 2]);
    // One more token: all three blocks can be reused.
    let mut q = p.clone();
    q.push(7);
    let hq = h.hash_blocks(&q, BS, None);
    assert_eq!(pool.lookup(&hq, 13), vec![1, 2, 3]);
    assert!(pool.lookup(&[], 0).is_empty());
}

#[test]
fn freed_blocks_keep_their_hash_and_are_revived_by_lookup() {
    let (mut pool, h) = setup(8);
    let p = toks(0..9);
    let blocks = prefill(&mut pool, &h, &p);
    pool.free(&blocks).unwrap();
    // Reverse order: the partial block 3, then 2, then 1 (chain tail first).
    assert_eq!(pool.free_list(), vec![4, 5, 6, 7, 3, 2, 1]);
    let hp = h.hash_blocks(&p, BS, None);
    assert_eq!(pool.lookup(&hp, 9), vec![1, 2]);
    assert_eq!(pool.free_list(), vec![4, 5, 6, 7, 3]);
    assert_eq!(pool.stats().evictions, 0);
    pool.check_invariants().unwrap();
}

#[test]
fn reallocation_evicts_the_oldest_cached_block_chain_tail_first() {
    let (mut pool, h) = setup(7); // usable 1..=6
    let a = toks(0..8); // 2 full blocks
    let b = toks(50..58);
    let ab = prefill(&mut pool, &h, &a);
    let bb = prefill(&mut pool, &h, &b);
    assert_eq!((ab.clone(), bb.clone()), (vec![1, 2], vec![3, 4]));
    pool.free(&ab).unwrap();
    pool.free(&bb).unwrap();
    assert_eq!(pool.free_list(), vec![5, 6, 2, 1, 4, 3]);

    // Uncached blocks first, then A's tail (2) before A's head (1).
    assert_eq!(pool.allocate(3), Some(vec![5, 6, 2]));
    let s = pool.stats();
    assert_eq!((s.evictions, s.blocks_cached), (1, 3));
    let ha = h.hash_blocks(&a, BS, None);
    let mut a_more = a.clone();
    a_more.push(1);
    // A's first block still hits; its second was evicted.
    assert_eq!(pool.lookup(&ha, a_more.len()), vec![1]);
    // B is intact.
    let hb = h.hash_blocks(&b, BS, None);
    assert_eq!(pool.lookup(&hb, 9), vec![3, 4]);
    pool.check_invariants().unwrap();
}

#[test]
fn insert_is_idempotent_and_duplicates_stay_uncached() {
    let (mut pool, h) = setup(10);
    let p = toks(0..8);
    let hp = h.hash_blocks(&p, BS, None);
    let x = pool.allocate(2).unwrap();
    assert_eq!(pool.insert(&hp, &x), Ok(2));
    assert_eq!(pool.insert(&hp, &x), Ok(0));
    // Same content computed again in other blocks: the first copy wins.
    let y = pool.allocate(2).unwrap();
    assert_eq!(pool.insert(&hp, &y), Ok(0));
    assert_eq!(pool.stats().blocks_cached, 2);
    assert_eq!(pool.block_hash(y[0]), Ok(None));
    assert_eq!(pool.cached_block(hp[0]), Some(x[0]));
    pool.check_invariants().unwrap();
}

#[test]
fn bad_frees_change_nothing() {
    let (mut pool, _) = setup(6);
    let a = pool.allocate(3).unwrap(); // 1, 2, 3
    let before = pool.free_list();
    assert_eq!(pool.free(&[1, 0]), Err(KvError::UnknownBlock(0)));
    assert_eq!(pool.free(&[1, 6]), Err(KvError::UnknownBlock(6)));
    assert_eq!(pool.free(&[4]), Err(KvError::NotReferenced(4)));
    // Partial application must be rolled back: 3 and 2 hit zero first.
    assert_eq!(pool.free(&[2, 2, 3]), Err(KvError::NotReferenced(2)));
    assert_eq!(pool.free_list(), before);
    for id in &a {
        assert_eq!(pool.refcount(*id), Ok(1));
    }
    pool.check_invariants().unwrap();
    pool.free(&a).unwrap();
    assert_eq!(pool.free(&a), Err(KvError::NotReferenced(3)));
    pool.check_invariants().unwrap();
}

#[test]
fn bad_inserts_change_nothing() {
    let (mut pool, h) = setup(10);
    let p = toks(0..8);
    let hp = h.hash_blocks(&p, BS, None);
    let q = toks(20..28);
    let hq = h.hash_blocks(&q, BS, None);
    let x = pool.allocate(2).unwrap();
    assert_eq!(
        pool.insert(&hp, &x[..1]),
        Err(KvError::TooFewBlocks {
            needed: 2,
            given: 1
        })
    );
    assert_eq!(
        pool.insert(&hp, &[x[0], x[0]]),
        Err(KvError::DuplicateBlock(x[0]))
    );
    assert_eq!(
        pool.insert(&hp, &[x[0], 9]),
        Err(KvError::InsertFreeBlock(9))
    );
    assert_eq!(
        pool.insert(&hp, &[x[0], 10]),
        Err(KvError::UnknownBlock(10))
    );
    assert_eq!(pool.stats().blocks_cached, 0);
    pool.insert(&hp, &x).unwrap();
    assert_eq!(pool.insert(&hq, &x), Err(KvError::ConflictingHash(x[0])));
    assert_eq!(pool.stats().blocks_cached, 2);
    pool.check_invariants().unwrap();
}

#[test]
fn config_limits() {
    assert!(BlockPool::new(1, 16).is_err());
    assert!(BlockPool::new(usize::MAX, 16).is_err());
    assert!(BlockPool::new(4, 0).is_err());
    assert!(BlockPool::new(4, 1 << 20).is_err());
}

#[test]
fn hashes_chain_and_depend_on_seed_and_salt() {
    let p = toks(0..12);
    let a = ChainHasher::from_seed(1).hash_blocks(&p, BS, None);
    let b = ChainHasher::from_seed(2).hash_blocks(&p, BS, None);
    assert_eq!(a.len(), 3);
    assert!(a.iter().zip(&b).all(|(x, y)| x != y));
    // Same tokens in block 1, different block 0: block 1's hash differs.
    let mut q = p.clone();
    q[0] = 99;
    let c = ChainHasher::from_seed(1).hash_blocks(&q, BS, None);
    assert_ne!(a[1], c[1]);
    let empty = ChainHasher::from_seed(1).hash_blocks(&p, BS, Some(b""));
    assert_ne!(a[0], empty[0], "empty salt differs from no salt");
    let r1 = ChainHasher::random();
    let r2 = ChainHasher::random();
    assert_ne!(r1.root(), r2.root());
    assert!(BlockHash::from_raw(0).is_none());
}

/// Random operations against invariants (a small LCG keeps it deterministic).
#[test]
fn random_operations_keep_invariants() {
    let (mut pool, h) = setup(24);
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut rnd = move |n: u64| {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) % n
    };
    let mut held: Vec<Vec<u32>> = Vec::new();
    for _ in 0..5000 {
        match rnd(4) {
            0 => {
                let len = rnd(30) as u32;
                let base = rnd(3) as u32 * 4;
                let p: Vec<u32> = (base..base + len).collect();
                let hp = h.hash_blocks(&p, BS, None);
                let mut b = pool.lookup(&hp, p.len());
                let need = p.len().div_ceil(BS).saturating_sub(b.len());
                match pool.allocate(need) {
                    Some(more) => {
                        b.extend(more);
                        pool.insert(&hp, &b).unwrap();
                        held.push(b);
                    }
                    None => pool.free(&b).unwrap(),
                }
            }
            1 | 2 if !held.is_empty() => {
                let i = rnd(held.len() as u64) as usize;
                let b = held.swap_remove(i);
                pool.free(&b).unwrap();
            }
            _ => {
                let n = rnd(6) as usize;
                if let Some(b) = pool.allocate(n) {
                    held.push(b);
                }
            }
        }
        pool.check_invariants().unwrap();
        let refs: usize = held.iter().map(Vec::len).sum();
        let total_refs: usize = (1..24).map(|i| pool.refcount(i).unwrap() as usize).sum();
        assert_eq!(refs, total_refs);
    }
}

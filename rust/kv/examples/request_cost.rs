//! Core-only cost of one 8k-token request (no Python): `cargo run --release -p cairn-kv --example request_cost`.
use std::time::Instant;

use cairn_kv::{BlockPool, ChainHasher};

fn main() {
    let (bs, prompt, cached) = (16usize, 8192usize, 4096usize);
    let mut pool = BlockPool::new(2048, bs).unwrap();
    let h = ChainHasher::from_seed(0);
    let mut x: u32 = 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        x % 49152
    };
    let prefix: Vec<u32> = (0..cached).map(|_| next()).collect();
    let prompts: Vec<Vec<u32>> = (0..200)
        .map(|_| {
            prefix
                .iter()
                .copied()
                .chain((0..prompt - cached).map(|_| next()))
                .collect()
        })
        .collect();
    let first = pool.allocate(cached / bs).unwrap();
    pool.insert(&h.hash_blocks(&prefix, bs, None), &first)
        .unwrap();
    pool.free(&first).unwrap();
    let (mut t_hash, mut t_ops) = (0.0, 0.0);
    let rounds = 5;
    for _ in 0..rounds {
        for p in &prompts {
            let t0 = Instant::now();
            let hashes = h.hash_blocks(p, bs, None);
            let t1 = Instant::now();
            let mut blocks = pool.lookup(&hashes, p.len());
            assert_eq!(blocks.len(), cached / bs);
            blocks.extend(pool.allocate(prompt / bs - blocks.len()).unwrap());
            pool.insert(&hashes, &blocks).unwrap();
            pool.free(&blocks).unwrap();
            let t2 = Instant::now();
            t_hash += (t1 - t0).as_secs_f64();
            t_ops += (t2 - t1).as_secs_f64();
        }
    }
    let n = (rounds * prompts.len()) as f64;
    println!(
        "hash {:.1} µs, table ops {:.1} µs per request",
        t_hash / n * 1e6,
        t_ops / n * 1e6
    );
}

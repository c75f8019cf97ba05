//! Random operation sequences on BlockPool + prefix table, checked step by
//! step against a plain model that keys cached blocks by their full content.
#![no_main]

use std::collections::HashMap;

use arbitrary::Arbitrary;
use cairn_kv::{BlockPool, ChainHasher};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
enum Op {
    Allocate(u8),
    FreeHeld(u8),
    FreeRaw(Vec<u8>),
    Lookup {
        stem: u8,
        tail: Vec<u8>,
        salt: u8,
    },
    InsertHeld {
        stem: u8,
        tail: Vec<u8>,
        salt: u8,
        which: u8,
    },
    InsertRaw {
        stem: u8,
        tail: Vec<u8>,
        salt: u8,
        ids: Vec<u8>,
    },
    Request {
        stem: u8,
        tail: Vec<u8>,
        salt: u8,
    },
}

type Key = (u8, Vec<u32>);

struct Model {
    bs: usize,
    refc: Vec<u32>,
    free: Vec<u32>,
    key_of: HashMap<u32, Key>,
    table: HashMap<Key, u32>,
}

impl Model {
    fn keys(&self, toks: &[u32], salt: u8) -> Vec<Key> {
        (1..=toks.len() / self.bs)
            .map(|i| (salt, toks[..i * self.bs].to_vec()))
            .collect()
    }
    fn allocate(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free.len() {
            return None;
        }
        let out: Vec<u32> = self.free.drain(..n).collect();
        for b in &out {
            if let Some(k) = self.key_of.remove(b) {
                self.table.remove(&k);
            }
            self.refc[*b as usize] = 1;
        }
        Some(out)
    }
    fn free_ok(&self, ids: &[u32]) -> bool {
        let mut need: HashMap<u32, u32> = HashMap::new();
        for &b in ids {
            *need.entry(b).or_default() += 1;
        }
        need.iter()
            .all(|(&b, &k)| b != 0 && (b as usize) < self.refc.len() && self.refc[b as usize] >= k)
    }
    fn release(&mut self, ids: &[u32]) {
        for &b in ids.iter().rev() {
            self.refc[b as usize] -= 1;
            if self.refc[b as usize] == 0 {
                self.free.push(b);
            }
        }
    }
    fn lookup(&mut self, toks: &[u32], salt: u8) -> Vec<u32> {
        let limit = toks.len().saturating_sub(1) / self.bs;
        let mut out = Vec::new();
        for k in self.keys(toks, salt).into_iter().take(limit) {
            let Some(&b) = self.table.get(&k) else { break };
            if self.refc[b as usize] == 0 {
                self.free.retain(|&x| x != b);
            }
            self.refc[b as usize] += 1;
            out.push(b);
        }
        out
    }
    fn insert_ok(&self, keys: &[Key], ids: &[u32]) -> bool {
        if ids.len() < keys.len() {
            return false;
        }
        let ids = &ids[..keys.len()];
        let mut seen = std::collections::HashSet::new();
        keys.iter().zip(ids).all(|(k, &b)| {
            b != 0
                && (b as usize) < self.refc.len()
                && self.refc[b as usize] > 0
                && seen.insert(b)
                && self.key_of.get(&b).is_none_or(|old| old == k)
        })
    }
    fn insert(&mut self, keys: &[Key], ids: &[u32]) -> usize {
        let mut added = 0;
        for (k, &b) in keys.iter().zip(ids) {
            if self.key_of.contains_key(&b) || self.table.contains_key(k) {
                continue;
            }
            self.table.insert(k.clone(), b);
            self.key_of.insert(b, k.clone());
            added += 1;
        }
        added
    }
}

const STEMS: [&[u32]; 3] = [
    &[1, 2, 3, 4, 5, 6, 7, 8],
    &[1, 2, 3, 4, 9, 9, 9, 9],
    &[5; 8],
];

fn prompt(stem: u8, tail: &[u8]) -> Vec<u32> {
    let s = STEMS[stem as usize % 3];
    let cut = (stem as usize / 3) % (s.len() + 1);
    let mut p = s[..cut].to_vec();
    p.extend(tail.iter().take(12).map(|&t| u32::from(t % 4)));
    p
}

/// Three salts: none, [1], [2]. The model keys by the same reduced value.
fn salt_of(salt: u8) -> u8 {
    salt % 3
}

fn salt_bytes(salt: u8) -> Option<Vec<u8>> {
    (salt != 0).then(|| vec![salt])
}

fuzz_target!(|input: (u8, u8, Vec<Op>)| {
    let (nb, bs, ops) = input;
    let num_blocks = 2 + nb as usize % 30;
    let bs = 1 + bs as usize % 4;
    let mut pool = BlockPool::new(num_blocks, bs).unwrap();
    let hasher = ChainHasher::from_seed(9);
    let mut m = Model {
        bs,
        refc: vec![0; num_blocks],
        free: (1..num_blocks as u32).collect(),
        key_of: HashMap::new(),
        table: HashMap::new(),
    };
    let mut held: Vec<Vec<u32>> = Vec::new();
    let hash = |toks: &[u32], salt: u8| hasher.hash_blocks(toks, bs, salt_bytes(salt).as_deref());
    for op in ops.into_iter().take(200) {
        match op {
            Op::Allocate(n) => {
                let got = pool.allocate(n as usize % (num_blocks + 2));
                assert_eq!(got, m.allocate(n as usize % (num_blocks + 2)));
                held.extend(got.filter(|g| !g.is_empty()));
            }
            Op::FreeHeld(i) if !held.is_empty() => {
                let ids = held.swap_remove(i as usize % held.len());
                pool.free(&ids).unwrap();
                m.release(&ids);
            }
            Op::FreeHeld(_) => {}
            Op::FreeRaw(ids) => {
                // Only ids nobody legitimately holds may be freed here: expect
                // an error unless the model says the free is valid.
                let ids: Vec<u32> = ids
                    .iter()
                    .map(|&b| u32::from(b) % (num_blocks as u32 + 2))
                    .collect();
                if m.free_ok(&ids) {
                    continue; // would steal a reference `held` owns
                }
                let before = pool.free_list();
                assert!(pool.free(&ids).is_err());
                assert_eq!(pool.free_list(), before);
            }
            Op::Lookup { stem, tail, salt } => {
                let salt = salt_of(salt);
                let p = prompt(stem, &tail);
                let got = pool.lookup(&hash(&p, salt), p.len());
                assert_eq!(got, m.lookup(&p, salt));
                if !got.is_empty() {
                    held.push(got);
                }
            }
            Op::InsertHeld {
                stem,
                tail,
                salt,
                which,
            } if !held.is_empty() => {
                let salt = salt_of(salt);
                let p = prompt(stem, &tail);
                let ids = held[which as usize % held.len()].clone();
                let keys = m.keys(&p, salt);
                let r = pool.insert(&hash(&p, salt), &ids);
                if m.insert_ok(&keys, &ids) {
                    assert_eq!(r, Ok(m.insert(&keys, &ids)));
                } else {
                    assert!(r.is_err());
                }
            }
            Op::InsertHeld { .. } => {}
            Op::InsertRaw {
                stem,
                tail,
                salt,
                ids,
            } => {
                let salt = salt_of(salt);
                let p = prompt(stem, &tail);
                let ids: Vec<u32> = ids
                    .iter()
                    .map(|&b| u32::from(b) % (num_blocks as u32 + 1))
                    .collect();
                let keys = m.keys(&p, salt);
                let before = (pool.free_list(), pool.stats());
                let r = pool.insert(&hash(&p, salt), &ids);
                if m.insert_ok(&keys, &ids) {
                    assert_eq!(r, Ok(m.insert(&keys, &ids)));
                } else {
                    assert!(r.is_err());
                    assert_eq!((pool.free_list(), pool.stats()), before);
                }
            }
            Op::Request { stem, tail, salt } => {
                let salt = salt_of(salt);
                let p = prompt(stem, &tail);
                let h = hash(&p, salt);
                let hit = pool.lookup(&h, p.len());
                assert_eq!(hit, m.lookup(&p, salt));
                let need = p.len().div_ceil(bs) - hit.len();
                let new = pool.allocate(need);
                assert_eq!(new, m.allocate(need));
                match new {
                    None => {
                        pool.free(&hit).unwrap();
                        m.release(&hit);
                    }
                    Some(new) => {
                        let ids = [hit, new].concat();
                        let keys = m.keys(&p, salt);
                        assert_eq!(pool.insert(&h, &ids), Ok(m.insert(&keys, &ids)));
                        if !ids.is_empty() {
                            held.push(ids);
                        }
                    }
                }
            }
        }
        // Invariants after every step.
        pool.check_invariants().unwrap();
        let mut refs = vec![0u32; num_blocks];
        for b in held.iter().flatten() {
            refs[*b as usize] += 1;
        }
        let got: Vec<u32> = (0..num_blocks as u32)
            .map(|b| pool.refcount(b).unwrap())
            .collect();
        assert_eq!(got, refs);
        assert_eq!(got, m.refc);
        assert_eq!(pool.free_list(), m.free);
        let s = pool.stats();
        assert_eq!(s.blocks_free + s.blocks_in_use, s.blocks_total);
        assert_eq!(s.blocks_cached, m.table.len());
        for b in 0..num_blocks as u32 {
            let want = m
                .key_of
                .get(&b)
                .map(|(salt, toks)| *hash(toks, *salt).last().unwrap());
            assert_eq!(pool.block_hash(b).unwrap(), want);
        }
    }
});

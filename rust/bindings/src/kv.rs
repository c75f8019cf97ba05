//! Python wrappers for `cairn-kv`: `BlockPool`, `PrefixCache`, `BlockHashes`.
//!
//! One `Arc<Mutex<BlockPool>>` is shared by a pool and every cache built on
//! it, so `allocate` through either evicts from the same prefix table. The
//! lock is only held for the O(blocks) table work, never while calling back
//! into Python or while hashing (hashing runs with the GIL released).
use std::sync::{Arc, Mutex, MutexGuard};

use cairn_kv::{BlockHash, BlockPool, ChainHasher, KvError};
use pyo3::exceptions::{PyIndexError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::detach_if;

mod args;
use args::{block_ids, count_arg, int_item, int_seq, salt_bytes};

/// Prompts at least this long are hashed with the GIL released.
const DETACH_MIN_TOKENS: usize = 256;
/// Token ids must lie in `0..TOKEN_LIMIT` (they fit an int32 buffer).
const TOKEN_LIMIT: i64 = 1 << 31;

fn kv_err(e: KvError) -> PyErr {
    PyValueError::new_err(e.to_string())
}

type Shared = Arc<Mutex<BlockPool>>;

fn lock(shared: &Shared) -> MutexGuard<'_, BlockPool> {
    // A panic inside the core is a bug that already surfaced as an exception;
    // the pool's own checks decide whether its state is still usable.
    shared.lock().unwrap_or_else(|e| e.into_inner())
}

/// Fixed-size KV block allocator (see `mlx_cairn.kv.BlockPool`).
#[pyclass(name = "BlockPool", module = "mlx_cairn._core", frozen)]
pub struct PyBlockPool {
    shared: Shared,
    num_blocks: usize,
    block_size: usize,
}

#[pymethods]
impl PyBlockPool {
    #[new]
    fn new(num_blocks: &Bound<'_, PyAny>, block_size: &Bound<'_, PyAny>) -> PyResult<Self> {
        let n = count_arg(num_blocks, "num_blocks")?;
        let bs = count_arg(block_size, "block_size")?;
        let pool = BlockPool::new(n, bs).map_err(kv_err)?;
        Ok(PyBlockPool {
            shared: Arc::new(Mutex::new(pool)),
            num_blocks: n,
            block_size: bs,
        })
    }

    #[getter]
    fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.block_size
    }

    #[getter]
    fn num_free_blocks(&self) -> usize {
        lock(&self.shared).num_free()
    }

    fn allocate(&self, n: &Bound<'_, PyAny>) -> PyResult<Option<Vec<u32>>> {
        let n = count_arg(n, "n")?;
        Ok(lock(&self.shared).allocate(n))
    }

    fn free(&self, block_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = self::block_ids(block_ids)?;
        lock(&self.shared).free(&ids).map_err(kv_err)
    }

    fn refcount(&self, block_id: &Bound<'_, PyAny>) -> PyResult<u32> {
        let id = int_item(block_id, self.num_blocks as i64, "block id")?;
        lock(&self.shared).refcount(id).map_err(kv_err)
    }

    fn free_list(&self) -> Vec<u32> {
        lock(&self.shared).free_list()
    }

    fn check_invariants(&self) -> PyResult<()> {
        lock(&self.shared)
            .check_invariants()
            .map_err(PyRuntimeError::new_err)
    }

    fn __repr__(&self) -> String {
        format!(
            "BlockPool(num_blocks={}, block_size={}, free={})",
            self.num_blocks,
            self.block_size,
            lock(&self.shared).num_free()
        )
    }
}

/// Precomputed chained hashes of a prompt's full blocks (salt included).
#[pyclass(name = "BlockHashes", module = "mlx_cairn._core", frozen)]
pub struct PyBlockHashes {
    hashes: Vec<BlockHash>,
    num_tokens: usize,
    root: u128,
    block_size: usize,
    // Kept so that extending an empty prefix still salts the first block.
    salt: Option<Vec<u8>>,
}

#[pymethods]
impl PyBlockHashes {
    #[getter]
    fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    fn __len__(&self) -> usize {
        self.hashes.len()
    }

    fn __getitem__(&self, index: isize) -> PyResult<u128> {
        let n = self.hashes.len() as isize;
        let i = if index < 0 { index + n } else { index };
        if (0..n).contains(&i) {
            Ok(self.hashes[i as usize].get())
        } else {
            Err(PyIndexError::new_err("block hash index out of range"))
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "BlockHashes(blocks={}, num_tokens={})",
            self.hashes.len(),
            self.num_tokens
        )
    }
}

/// Content-addressed prefix cache over a `BlockPool`.
#[pyclass(name = "PrefixCache", module = "mlx_cairn._core", frozen)]
pub struct PyPrefixCache {
    pool: Py<PyBlockPool>,
    shared: Shared,
    hasher: ChainHasher,
    block_size: usize,
}

impl PyPrefixCache {
    fn compute(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        salt: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyBlockHashes> {
        let toks = int_seq(tokens, TOKEN_LIMIT, "token id")?;
        let salt = salt_bytes(salt)?;
        let (hasher, bs) = (self.hasher, self.block_size);
        let run = || hasher.hash_blocks(&toks, bs, salt.as_deref());
        let hashes = detach_if(py, toks.len() >= DETACH_MIN_TOKENS, run);
        Ok(PyBlockHashes {
            hashes,
            num_tokens: toks.len(),
            root: hasher.root(),
            block_size: bs,
            salt,
        })
    }

    fn check_same_cache(&self, h: &PyBlockHashes) -> PyResult<()> {
        if h.root != self.hasher.root() || h.block_size != self.block_size {
            return Err(PyValueError::new_err(
                "these BlockHashes come from a different PrefixCache",
            ));
        }
        Ok(())
    }

    /// `prefix` followed by `tokens` (the prefix must end on a block boundary).
    fn extend(
        &self,
        py: Python<'_>,
        prefix: &PyBlockHashes,
        tokens: &Bound<'_, PyAny>,
    ) -> PyResult<PyBlockHashes> {
        self.check_same_cache(prefix)?;
        let bs = self.block_size;
        if prefix.num_tokens % bs != 0 {
            return Err(PyValueError::new_err(format!(
                "prefix covers {} tokens, not a whole number of {bs}-token blocks",
                prefix.num_tokens
            )));
        }
        let toks = int_seq(tokens, TOKEN_LIMIT, "token id")?;
        let hasher = self.hasher;
        let run = || match prefix.hashes.last() {
            Some(&parent) => hasher.extend(parent, &toks, bs),
            None => hasher.hash_blocks(&toks, bs, prefix.salt.as_deref()),
        };
        let more = detach_if(py, toks.len() >= DETACH_MIN_TOKENS, run);
        let mut hashes = Vec::with_capacity(prefix.hashes.len() + more.len());
        hashes.extend_from_slice(&prefix.hashes);
        hashes.extend(more);
        Ok(PyBlockHashes {
            hashes,
            num_tokens: prefix.num_tokens + toks.len(),
            root: prefix.root,
            block_size: bs,
            salt: prefix.salt.clone(),
        })
    }

    /// Runs `f` on the hashes of `tokens`, which may be a `BlockHashes`.
    fn with_hashes<R>(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        salt: Option<&Bound<'_, PyAny>>,
        f: impl FnOnce(&[BlockHash], usize) -> R,
    ) -> PyResult<R> {
        if let Ok(h) = tokens.cast::<PyBlockHashes>() {
            let h = h.get();
            if salt.is_some_and(|s| !s.is_none()) {
                return Err(PyValueError::new_err(
                    "salt is already part of these BlockHashes",
                ));
            }
            self.check_same_cache(h)?;
            return Ok(f(&h.hashes, h.num_tokens));
        }
        let h = self.compute(py, tokens, salt)?;
        Ok(f(&h.hashes, h.num_tokens))
    }
}

#[pymethods]
impl PyPrefixCache {
    #[new]
    #[pyo3(signature = (pool, seed=None))]
    fn new(pool: Bound<'_, PyBlockPool>, seed: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let hasher = match seed {
            None => ChainHasher::random(),
            Some(s) => {
                let v = match s.extract::<u64>() {
                    Ok(v) => v,
                    Err(_) => s.extract::<i64>().map(|v| v as u64).map_err(|_| {
                        PyValueError::new_err("seed must be an int that fits in 64 bits")
                    })?,
                };
                ChainHasher::from_seed(v)
            }
        };
        let p = pool.get();
        Ok(PyPrefixCache {
            shared: p.shared.clone(),
            block_size: p.block_size,
            pool: pool.unbind(),
            hasher,
        })
    }

    #[getter]
    fn pool(&self, py: Python<'_>) -> Py<PyBlockPool> {
        self.pool.clone_ref(py)
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.block_size
    }

    #[pyo3(signature = (tokens, salt=None, *, prefix=None))]
    fn hash_blocks(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        salt: Option<&Bound<'_, PyAny>>,
        prefix: Option<&Bound<'_, PyBlockHashes>>,
    ) -> PyResult<PyBlockHashes> {
        match prefix {
            None => self.compute(py, tokens, salt),
            Some(_) if salt.is_some_and(|s| !s.is_none()) => Err(PyValueError::new_err(
                "salt is already part of the prefix BlockHashes",
            )),
            Some(p) => self.extend(py, p.get(), tokens),
        }
    }

    #[pyo3(signature = (tokens, salt=None))]
    fn lookup(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        salt: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<u32>> {
        self.with_hashes(py, tokens, salt, |h, n| lock(&self.shared).lookup(h, n))
    }

    #[pyo3(signature = (tokens, block_ids, salt=None))]
    fn insert(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        block_ids: &Bound<'_, PyAny>,
        salt: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let ids = self::block_ids(block_ids)?;
        self.with_hashes(py, tokens, salt, |h, _| lock(&self.shared).insert(h, &ids))?
            .map_err(kv_err)
    }

    fn block_hash(&self, block_id: &Bound<'_, PyAny>) -> PyResult<Option<u128>> {
        // Extract before locking: int conversion may run Python code.
        let n = lock(&self.shared).num_blocks();
        let id = int_item(block_id, n as i64, "block id")?;
        Ok(lock(&self.shared)
            .block_hash(id)
            .map_err(kv_err)?
            .map(BlockHash::get))
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = lock(&self.shared).stats();
        let d = PyDict::new(py);
        d.set_item("blocks_total", s.blocks_total)?;
        d.set_item("blocks_free", s.blocks_free)?;
        d.set_item("blocks_in_use", s.blocks_in_use)?;
        d.set_item("blocks_cached", s.blocks_cached)?;
        d.set_item("lookups", s.lookups)?;
        d.set_item("hit_tokens", s.hit_tokens)?;
        d.set_item("miss_tokens", s.miss_tokens)?;
        d.set_item("evictions", s.evictions)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!(
            "PrefixCache(block_size={}, cached={})",
            self.block_size,
            lock(&self.shared).stats().blocks_cached
        )
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyBlockPool>()?;
    m.add_class::<PyPrefixCache>()?;
    m.add_class::<PyBlockHashes>()?;
    Ok(())
}

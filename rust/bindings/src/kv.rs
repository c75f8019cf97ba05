//! Python wrappers for `cairn-kv`: `BlockPool`, `PrefixCache`, `BlockHashes`.
//!
//! One `Arc<Mutex<BlockPool>>` is shared by a pool and every cache built on
//! it, so `allocate` through either evicts from the same prefix table. The
//! lock is only held for the O(blocks) table work, never while calling back
//! into Python or while hashing (hashing runs with the GIL released).
use std::sync::{Arc, Mutex, MutexGuard};

use cairn_kv::{BlockHash, BlockPool, ChainHasher, KvError};
use pyo3::buffer::{ElementType, PyUntypedBuffer};
use pyo3::exceptions::{PyIndexError, PyOverflowError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::critical_section::with_critical_section;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple};

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

/// A non-negative count from a Python int, as a ValueError when it is not.
fn count_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    match obj.extract::<i64>() {
        Ok(v) if v >= 0 => Ok(v as usize),
        Ok(v) => Err(PyValueError::new_err(format!(
            "{what} must be >= 0, got {v}"
        ))),
        Err(e) if e.is_instance_of::<PyOverflowError>(obj.py()) => Err(PyValueError::new_err(
            format!("{what} is out of range: {obj}"),
        )),
        Err(e) => Err(e),
    }
}

fn check_range(v: i64, hi: i64, what: &str) -> PyResult<u32> {
    if (0..hi).contains(&v) {
        Ok(v as u32)
    } else {
        Err(PyValueError::new_err(format!(
            "{what} {v} is out of range 0..{hi}"
        )))
    }
}

fn int_item(item: &Bound<'_, PyAny>, hi: i64, what: &str) -> PyResult<u32> {
    match item.extract::<i64>() {
        Ok(v) => check_range(v, hi, what),
        Err(e) if e.is_instance_of::<PyOverflowError>(item.py()) => Err(PyValueError::new_err(
            format!("{what} {item} is out of range 0..{hi}"),
        )),
        Err(_) => Err(PyTypeError::new_err(format!(
            "{what}s must be ints, got {}",
            item.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        ))),
    }
}

fn buffer_ints(obj: &Bound<'_, PyAny>, hi: i64, what: &str) -> PyResult<Vec<u32>> {
    let py = obj.py();
    let buf = PyUntypedBuffer::get(obj)?;
    if buf.dimensions() != 1 {
        return Err(PyValueError::new_err(format!(
            "{what}s must be a 1-D buffer, got {} dimensions",
            buf.dimensions()
        )));
    }
    // One memcpy out of the buffer, one validation pass, one narrowing pass
    // (which reuses the allocation when the widths match).
    macro_rules! conv {
        ($t:ty) => {{
            let v: Vec<$t> = buf.as_typed::<$t>()?.to_vec(py)?;
            let ok = |x: $t| i64::try_from(x).is_ok_and(|x| (0..hi).contains(&x));
            if let Some(bad) = v.iter().copied().find(|&x| !ok(x)) {
                return Err(PyValueError::new_err(format!(
                    "{what} {bad} is out of range 0..{hi}"
                )));
            }
            Ok(v.into_iter().map(|x| x as u32).collect())
        }};
    }
    match ElementType::from_format(buf.format()) {
        ElementType::SignedInteger { bytes: 4 } => conv!(i32),
        ElementType::UnsignedInteger { bytes: 4 } => conv!(u32),
        ElementType::SignedInteger { bytes: 8 } => conv!(i64),
        ElementType::UnsignedInteger { bytes: 8 } => conv!(u64),
        ElementType::SignedInteger { bytes: 2 } => conv!(i16),
        ElementType::UnsignedInteger { bytes: 2 } => conv!(u16),
        _ => Err(PyTypeError::new_err(format!(
            "{what}s buffer must hold integers (int32 preferred), got format {:?}",
            buf.format()
        ))),
    }
}

/// Integers from a list, reading exact small ints straight from the list.
fn list_ints(list: &Bound<'_, PyList>, hi: i64, what: &str) -> PyResult<Vec<u32>> {
    with_critical_section(list.as_any(), || {
        let mut out = Vec::with_capacity(list.len());
        let mut i = 0;
        // Re-read the length each time: the slow path may run Python code.
        while i < list.len() {
            // SAFETY: `i` is below the length just read; the GIL (or, free-threaded,
            // the critical section) keeps other threads from changing the list, and
            // no Python code runs between the length check and this read.
            let item = unsafe { ffi::PyList_GET_ITEM(list.as_ptr(), i as ffi::Py_ssize_t) };
            // SAFETY: `item` is a valid borrowed reference (see above).
            if unsafe { ffi::PyLong_CheckExact(item) } != 0 {
                let mut overflow = 0;
                // SAFETY: an exact int; this cannot fail other than by overflow.
                let v = unsafe { ffi::PyLong_AsLongAndOverflow(item, &mut overflow) } as i64;
                if overflow == 0 && (0..hi).contains(&v) {
                    out.push(v as u32);
                    i += 1;
                    continue;
                }
            }
            out.push(int_item(&list.get_item(i)?, hi, what)?);
            i += 1;
        }
        Ok(out)
    })
}

/// Integers in `0..hi` from a list, tuple, integer buffer or other iterable.
fn int_seq(obj: &Bound<'_, PyAny>, hi: i64, what: &str) -> PyResult<Vec<u32>> {
    if let Ok(list) = obj.cast::<PyList>() {
        return list_ints(list, hi, what);
    }
    if let Ok(t) = obj.cast::<PyTuple>() {
        return t.iter().map(|x| int_item(&x, hi, what)).collect();
    }
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(PyTypeError::new_err(format!(
            "{what}s must be a list of ints or an integer buffer, not {}",
            obj.get_type().name()?
        )));
    }
    // SAFETY: PyObject_CheckBuffer only inspects the type's slots.
    if unsafe { pyo3::ffi::PyObject_CheckBuffer(obj.as_ptr()) } != 0 {
        return buffer_ints(obj, hi, what);
    }
    let it = obj.try_iter().map_err(|_| {
        PyTypeError::new_err(format!(
            "{what}s must be a list of ints or an integer buffer, not {}",
            obj.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        ))
    })?;
    it.map(|x| int_item(&x?, hi, what)).collect()
}

fn block_ids(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    int_seq(obj, i64::from(u32::MAX), "block id")
}

fn salt_bytes(salt: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Vec<u8>>> {
    let Some(s) = salt else { return Ok(None) };
    if s.is_none() {
        Ok(None)
    } else if let Ok(s) = s.cast::<PyString>() {
        Ok(Some(s.to_str()?.as_bytes().to_vec()))
    } else if let Ok(b) = s.cast::<PyBytes>() {
        Ok(Some(b.as_bytes().to_vec()))
    } else {
        Err(PyTypeError::new_err("salt must be str, bytes or None"))
    }
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
        let hashes = if toks.len() >= DETACH_MIN_TOKENS {
            py.detach(run)
        } else {
            run()
        };
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
        let more = if toks.len() >= DETACH_MIN_TOKENS {
            py.detach(run)
        } else {
            run()
        };
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

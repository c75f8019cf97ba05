//! Python wrappers for `cairn-constrain`: `GrammarVocabulary`, `CompiledGrammar`,
//! `GrammarMatcher`. Compiling and computing masks run with the GIL released.
use std::sync::{Arc, Mutex, MutexGuard};

use cairn_constrain::{Compiled, ConstrainError, Grammar, RowMatcher, Vocabulary};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

fn grammar_err(e: ConstrainError) -> PyErr {
    match e {
        ConstrainError::Step(m) => PyRuntimeError::new_err(m),
        other => PyValueError::new_err(other.to_string()),
    }
}

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock cannot leave these values half-updated
    // in a way later calls rely on; keep serving.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A tokenizer's token trie (built once per tokenizer).
#[pyclass(name = "GrammarVocabulary", module = "mlx_cairn._core", frozen)]
pub struct PyVocabulary {
    inner: Arc<Vocabulary>,
}

#[pymethods]
impl PyVocabulary {
    #[new]
    #[pyo3(signature = (tokenizer_json, eos_ids, width))]
    fn new(
        py: Python<'_>,
        tokenizer_json: &str,
        eos_ids: Vec<u32>,
        width: usize,
    ) -> PyResult<Self> {
        let json = tokenizer_json.to_owned();
        let v = py
            .detach(move || Vocabulary::from_tokenizer_json(&json, &eos_ids, width))
            .map_err(grammar_err)?;
        Ok(Self { inner: Arc::new(v) })
    }

    #[getter]
    fn width(&self) -> usize {
        self.inner.width()
    }

    /// Compile a JSON Schema (text); ValueError names what does not compile.
    fn compile_json_schema(&self, py: Python<'_>, schema: &str) -> PyResult<PyCompiled> {
        self.compile(py, Grammar::JsonSchema(schema.to_owned()))
    }

    /// Compile llguidance's Lark-like grammar; ValueError names what does not compile.
    fn compile_lark(&self, py: Python<'_>, grammar: &str) -> PyResult<PyCompiled> {
        self.compile(py, Grammar::Lark(grammar.to_owned()))
    }

    /// A fresh matcher for one generating row.
    fn matcher(&self, py: Python<'_>, grammar: &PyCompiled) -> PyResult<PyMatcher> {
        let compiled = locked(&grammar.inner).clone();
        let v = self.inner.clone();
        let m = py
            .detach(move || v.matcher(&compiled))
            .map_err(grammar_err)?;
        Ok(PyMatcher {
            inner: Mutex::new(m),
            width: self.inner.width(),
        })
    }
}

impl PyVocabulary {
    fn compile(&self, py: Python<'_>, g: Grammar) -> PyResult<PyCompiled> {
        let v = self.inner.clone();
        let c = py.detach(move || v.compile(&g)).map_err(grammar_err)?;
        Ok(PyCompiled {
            inner: Mutex::new(c),
        })
    }
}

/// A compiled grammar (one per request).
#[pyclass(name = "CompiledGrammar", module = "mlx_cairn._core", frozen)]
pub struct PyCompiled {
    inner: Mutex<Compiled>,
}

/// One row's matcher: consume sampled tokens, get the next token's mask.
#[pyclass(name = "GrammarMatcher", module = "mlx_cairn._core", frozen)]
pub struct PyMatcher {
    inner: Mutex<RowMatcher>,
    width: usize,
}

#[pymethods]
impl PyMatcher {
    /// Advance by one sampled token (RuntimeError if the grammar refuses it).
    fn consume(&self, token: u32) -> PyResult<()> {
        locked(&self.inner).consume(token).map_err(grammar_err)
    }

    /// The next token's additive mask: `width` native-endian f32 (0.0 or -inf).
    fn mask<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let mut buf = vec![0f32; self.width];
        py.detach(|| locked(&self.inner).fill_mask(&mut buf))
            .map_err(grammar_err)?;
        Ok(PyBytes::new(py, f32_bytes(&buf)))
    }

    /// Write the next token's additive mask into `out`, a writable C-contiguous
    /// float32 buffer of `width` entries (a numpy array), with no copy in between.
    fn mask_into(&self, py: Python<'_>, out: &Bound<'_, PyAny>) -> PyResult<()> {
        let buf = PyBuffer::<f32>::get(out)?;
        if buf.readonly() || !buf.is_c_contiguous() || buf.item_count() != self.width {
            return Err(PyValueError::new_err(format!(
                "mask_into needs a writable contiguous float32 buffer of {} entries",
                self.width
            )));
        }
        // The buffer stays exported (and so alive and unmoved) while `buf` is held.
        let addr = buf.buf_ptr() as usize;
        let n = self.width;
        py.detach(|| {
            let slice = unsafe { std::slice::from_raw_parts_mut(addr as *mut f32, n) };
            locked(&self.inner).fill_mask(slice)
        })
        .map_err(grammar_err)?;
        drop(buf);
        Ok(())
    }

    /// Tokens that finish the grammar from here (at most `max_len`, within
    /// `effort` grammar checks), or None; the matcher itself does not move.
    #[pyo3(signature = (max_len, effort = 4096))]
    fn completion(&self, py: Python<'_>, max_len: usize, effort: usize) -> Option<Vec<u32>> {
        py.detach(|| locked(&self.inner).completion(max_len, effort))
    }

    /// `plan` written in exactly `n` tokens where it can be (longer tokens for runs of bytes).
    fn fit(&self, plan: Vec<u32>, n: usize) -> Vec<u32> {
        locked(&self.inner).fit(&plan, n)
    }

    /// The end-of-turn ids.
    #[getter]
    fn eos_ids(&self) -> Vec<u32> {
        locked(&self.inner).eos().to_vec()
    }

    fn is_accepting(&self) -> bool {
        locked(&self.inner).is_accepting()
    }

    fn is_stopped(&self) -> bool {
        locked(&self.inner).is_stopped()
    }
}

fn f32_bytes(v: &[f32]) -> &[u8] {
    // f32 has no padding and any bit pattern is a valid u8 sequence.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyVocabulary>()?;
    m.add_class::<PyCompiled>()?;
    m.add_class::<PyMatcher>()?;
    Ok(())
}

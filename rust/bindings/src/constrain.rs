//! Python wrappers for `cairn-constrain`: `GrammarVocabulary`, `CompiledGrammar`,
//! `GrammarMatcher`. Compiling and computing masks run with the GIL released.
use std::sync::{Arc, Mutex, MutexGuard};

use cairn_constrain::{Compiled, ConstrainError, Grammar, RowMatcher, Vocabulary};
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

    /// The next token's additive mask: `width` little-endian f32 (0.0 or -inf).
    fn mask<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let mut buf = vec![0f32; self.width];
        py.detach(|| locked(&self.inner).fill_mask(&mut buf))
            .map_err(grammar_err)?;
        let bytes: Vec<u8> = buf.iter().flat_map(|f| f.to_le_bytes()).collect();
        Ok(PyBytes::new(py, &bytes))
    }

    fn is_accepting(&self) -> bool {
        locked(&self.inner).is_accepting()
    }

    fn is_stopped(&self) -> bool {
        locked(&self.inner).is_stopped()
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyVocabulary>()?;
    m.add_class::<PyCompiled>()?;
    m.add_class::<PyMatcher>()?;
    Ok(())
}

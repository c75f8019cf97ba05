//! Python wrappers for `cairn-sse`: frame encoders and `SseDecoder`.
use std::sync::{Mutex, MutexGuard};

use cairn_sse::{
    encode_comment_into, encode_event_into, Decoder, Event, EventFields, SseError, PING_FRAME,
};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyString};

fn sse_err(e: SseError) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// Data as UTF-8 text: `str`, or `bytes`/`bytearray` holding valid UTF-8.
fn text_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<String> {
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(s.to_str()?.to_owned());
    }
    let bytes: Vec<u8> = if let Ok(b) = obj.cast::<PyBytes>() {
        b.as_bytes().to_vec()
    } else if let Ok(b) = obj.cast::<PyByteArray>() {
        b.to_vec()
    } else {
        return Err(PyTypeError::new_err(format!(
            "{what} must be str or UTF-8 bytes, not {}",
            obj.get_type().name()?
        )));
    };
    String::from_utf8(bytes)
        .map_err(|e| PyValueError::new_err(format!("{what} is not valid UTF-8: {e}")))
}

#[pyfunction]
#[pyo3(signature = (event, data, *, id=None, retry=None))]
fn encode_event<'py>(
    py: Python<'py>,
    event: Option<&str>,
    data: &Bound<'py, PyAny>,
    id: Option<&str>,
    retry: Option<u64>,
) -> PyResult<Bound<'py, PyBytes>> {
    let data = text_arg(data, "data")?;
    let mut out = Vec::with_capacity(data.len() + 32);
    encode_event_into(&mut out, event, &data, EventFields { id, retry }).map_err(sse_err)?;
    Ok(PyBytes::new(py, &out))
}

#[pyfunction]
#[pyo3(signature = (text=""))]
fn encode_comment<'py>(py: Python<'py>, text: &str) -> Bound<'py, PyBytes> {
    let mut out = Vec::with_capacity(text.len() + 4);
    encode_comment_into(&mut out, text);
    PyBytes::new(py, &out)
}

#[pyfunction]
fn encode_ping(py: Python<'_>) -> Bound<'_, PyBytes> {
    PyBytes::new(py, PING_FRAME)
}

/// One decoded event.
#[pyclass(name = "SseEvent", module = "mlx_cairn._core", frozen, eq)]
#[derive(PartialEq)]
pub struct PySseEvent {
    #[pyo3(get)]
    event: Option<String>,
    #[pyo3(get)]
    data: String,
    #[pyo3(get)]
    id: Option<String>,
    #[pyo3(get)]
    retry: Option<u64>,
}

#[pymethods]
impl PySseEvent {
    #[new]
    #[pyo3(signature = (data, event=None, id=None, retry=None))]
    fn new(data: String, event: Option<String>, id: Option<String>, retry: Option<u64>) -> Self {
        PySseEvent {
            event,
            data,
            id,
            retry,
        }
    }

    fn __repr__(&self) -> String {
        let mut s = format!("SseEvent(data={:?}", self.data);
        if let Some(e) = &self.event {
            s += &format!(", event={e:?}");
        }
        if let Some(i) = &self.id {
            s += &format!(", id={i:?}");
        }
        if let Some(r) = self.retry {
            s += &format!(", retry={r}");
        }
        s + ")"
    }
}

impl From<Event> for PySseEvent {
    fn from(e: Event) -> Self {
        PySseEvent {
            event: e.event,
            data: e.data,
            id: e.id,
            retry: e.retry,
        }
    }
}

/// Incremental WHATWG event-stream decoder.
#[pyclass(name = "SseDecoder", module = "mlx_cairn._core", frozen)]
pub struct PySseDecoder {
    inner: Mutex<Decoder>,
}

impl PySseDecoder {
    /// The decoder behind the lock.
    fn decoder(&self) -> MutexGuard<'_, Decoder> {
        // A panic inside the core already surfaced as an exception; the decoder's
        // own error checks decide what happens to the next chunk.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[pymethods]
impl PySseDecoder {
    #[new]
    #[pyo3(signature = (max_event_bytes=None))]
    fn new(max_event_bytes: Option<usize>) -> Self {
        let d = match max_event_bytes {
            Some(n) => Decoder::with_limit(n),
            None => Decoder::new(),
        };
        PySseDecoder {
            inner: Mutex::new(d),
        }
    }

    fn feed(&self, chunk: &Bound<'_, PyAny>) -> PyResult<Vec<PySseEvent>> {
        let bytes: Vec<u8> = if let Ok(b) = chunk.cast::<PyBytes>() {
            b.as_bytes().to_vec()
        } else if let Ok(b) = chunk.cast::<PyByteArray>() {
            b.to_vec()
        } else if let Ok(s) = chunk.cast::<PyString>() {
            s.to_str()?.as_bytes().to_vec()
        } else if let Ok(buf) = PyBuffer::<u8>::get(chunk) {
            buf.to_vec(chunk.py())?
        } else {
            return Err(PyTypeError::new_err(format!(
                "chunk must be bytes, bytearray, memoryview or str, not {}",
                chunk.get_type().name()?
            )));
        };
        let mut out = Vec::new();
        let mut d = self.decoder();
        d.feed(&bytes, &mut out).map_err(sse_err)?;
        drop(d);
        Ok(out.into_iter().map(PySseEvent::from).collect())
    }

    fn finish(&self) -> bool {
        self.decoder().finish()
    }

    #[getter]
    fn has_partial(&self) -> bool {
        self.decoder().has_partial()
    }

    #[getter]
    fn last_event_id(&self) -> Option<String> {
        self.decoder().last_event_id().map(String::from)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(encode_event, m)?)?;
    m.add_function(wrap_pyfunction!(encode_comment, m)?)?;
    m.add_function(wrap_pyfunction!(encode_ping, m)?)?;
    m.add_class::<PySseEvent>()?;
    m.add_class::<PySseDecoder>()?;
    Ok(())
}

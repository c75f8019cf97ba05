//! Python wrappers for `cairn-text`: StopScanner, OutputParser, TextPipeline,
//! Segment, parse_output and coalesce.
//!
//! Errors become `ValueError`. The GIL is released only for inputs of at
//! least [`DETACH_BYTES`]: per-token chunks are a few bytes, where handing
//! the GIL over would cost more than the scan itself.
use crate::detach_if;
use cairn_text::{self as core, Family, TextError, ToolSchemas};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyString};

/// Inputs this large are processed with the GIL released.
const DETACH_BYTES: usize = 16 * 1024;

fn value_error(e: TextError) -> PyErr {
    PyValueError::new_err(e.to_string())
}

fn parse_family(name: Option<&str>) -> PyResult<Option<Family>> {
    name.map(|n| n.parse::<Family>().map_err(value_error))
        .transpose()
}

/// `tool_schemas=`: JSON text, or a mapping / list that `json.dumps` writes.
fn parse_schemas(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<ToolSchemas>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(None);
    };
    let text: String = if let Ok(s) = obj.cast::<PyString>() {
        s.to_str()?.to_owned()
    } else {
        let json = obj.py().import("json")?;
        json.call_method1("dumps", (obj,))?.extract()?
    };
    ToolSchemas::from_json(&text).map(Some).map_err(value_error)
}

fn py_repr(py: Python<'_>, s: &str) -> PyResult<String> {
    Ok(PyString::new(py, s).repr()?.to_string())
}

/// `family=..., reasoning=..., starts_in_reasoning=...` as Python spells it.
fn settings_repr(p: &core::OutputParser) -> String {
    let b = |x: bool| if x { "True" } else { "False" };
    let fam = p
        .family()
        .map_or("None".to_owned(), |f| format!("'{}'", f.name()));
    format!(
        "family={fam}, reasoning={}, starts_in_reasoning={}",
        b(p.reasoning()),
        b(p.starts_in_reasoning())
    )
}

fn stops_repr(py: Python<'_>, stops: &[Py<PyString>]) -> PyResult<String> {
    Ok(PyList::new(py, stops)?.repr()?.to_string())
}

/// One piece of parsed model output (`kind` is text, reasoning or tool_call).
#[pyclass(module = "mlx_cairn._core", name = "Segment", frozen, eq, hash)]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct PySegment {
    inner: core::Segment,
}

#[pymethods]
impl PySegment {
    #[new]
    #[pyo3(
        signature = (kind, text = String::new(), *, name = None, arguments = None, raw = String::new()),
        text_signature = "(kind, text='', *, name=None, arguments=None, raw='')"
    )]
    fn new(
        kind: &str,
        text: String,
        name: Option<String>,
        arguments: Option<String>,
        raw: String,
    ) -> PyResult<Self> {
        let inner =
            match (kind, name, arguments) {
                ("text", None, None) if raw.is_empty() => core::Segment::Text(text),
                ("reasoning", None, None) if raw.is_empty() => core::Segment::Reasoning(text),
                ("tool_call", Some(name), Some(arguments)) if text.is_empty() => {
                    core::Segment::ToolCall(core::ToolCall {
                        name,
                        arguments,
                        raw,
                    })
                }
                ("text" | "reasoning", ..) => {
                    return Err(PyValueError::new_err(format!(
                        "a {kind} segment takes only `text`"
                    )))
                }
                ("tool_call", ..) => return Err(PyValueError::new_err(
                    "a tool_call segment takes `name`, `arguments` and optional `raw`, not `text`",
                )),
                _ => {
                    return Err(PyValueError::new_err(format!(
                        "unknown segment kind {kind:?}; expected text, reasoning or tool_call"
                    )))
                }
            };
        Ok(PySegment { inner })
    }

    /// "text", "reasoning" or "tool_call".
    #[getter]
    fn kind(&self) -> &'static str {
        match self.inner {
            core::Segment::Text(_) => "text",
            core::Segment::Reasoning(_) => "reasoning",
            core::Segment::ToolCall(_) => "tool_call",
        }
    }

    /// The text of a text or reasoning segment ("" for a tool call).
    #[getter]
    fn text(&self) -> &str {
        match &self.inner {
            core::Segment::Text(t) | core::Segment::Reasoning(t) => t,
            core::Segment::ToolCall(_) => "",
        }
    }

    /// The tool name (None unless a tool call).
    #[getter]
    fn name(&self) -> Option<&str> {
        match &self.inner {
            core::Segment::ToolCall(c) => Some(&c.name),
            _ => None,
        }
    }

    /// JSON text of the arguments object (None unless a tool call).
    #[getter]
    fn arguments(&self) -> Option<&str> {
        match &self.inner {
            core::Segment::ToolCall(c) => Some(&c.arguments),
            _ => None,
        }
    }

    /// The model's text of a tool call, without its tags ("" otherwise).
    #[getter]
    fn raw(&self) -> &str {
        match &self.inner {
            core::Segment::ToolCall(c) => &c.raw,
            _ => "",
        }
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(match &self.inner {
            core::Segment::Text(t) => format!("Segment('text', {})", py_repr(py, t)?),
            core::Segment::Reasoning(t) => format!("Segment('reasoning', {})", py_repr(py, t)?),
            core::Segment::ToolCall(c) => format!(
                "Segment('tool_call', name={}, arguments={})",
                py_repr(py, &c.name)?,
                py_repr(py, &c.arguments)?
            ),
        })
    }
}

fn wrap(segs: Vec<core::Segment>) -> Vec<PySegment> {
    segs.into_iter().map(|inner| PySegment { inner }).collect()
}

/// Streaming stop-sequence scanner.
#[pyclass(module = "mlx_cairn._core", name = "StopScanner")]
pub struct PyStopScanner {
    inner: core::StopScanner,
    stops: Vec<Py<PyString>>,
}

fn stop_objs(py: Python<'_>, stops: &[String]) -> Vec<Py<PyString>> {
    stops
        .iter()
        .map(|s| PyString::new(py, s).unbind())
        .collect()
}

#[pymethods]
impl PyStopScanner {
    #[new]
    fn new(py: Python<'_>, stops: Vec<String>) -> PyResult<Self> {
        let inner = core::StopScanner::new(&stops).map_err(value_error)?;
        Ok(PyStopScanner {
            inner,
            stops: stop_objs(py, &stops),
        })
    }

    /// The stop sequences, in priority order.
    #[getter]
    fn stops(&self) -> Vec<String> {
        self.inner.stops().to_vec()
    }

    /// Feeds text; returns (text safe to show, matched stop or None).
    fn push(&mut self, py: Python<'_>, text: &str) -> (String, Option<Py<PyString>>) {
        let inner = &mut self.inner;
        let (out, m) = detach_if(py, text.len() >= DETACH_BYTES, || inner.push(text));
        (out, m.map(|i| self.stops[i].clone_ref(py)))
    }

    /// Ends the stream: (held-back text, None); the scanner is then reset.
    fn flush(&mut self) -> (String, Option<Py<PyString>>) {
        (self.inner.flush(), None)
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!("StopScanner({})", stops_repr(py, &self.stops)?))
    }
}

/// Streaming parser for reasoning and tool-call tags.
#[pyclass(module = "mlx_cairn._core", name = "OutputParser")]
pub struct PyOutputParser {
    inner: core::OutputParser,
}

#[pymethods]
impl PyOutputParser {
    #[new]
    #[pyo3(signature = (family = None, reasoning = false, starts_in_reasoning = false, *, tool_schemas = None))]
    fn new(
        family: Option<&str>,
        reasoning: bool,
        starts_in_reasoning: bool,
        tool_schemas: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let mut inner =
            core::OutputParser::new(parse_family(family)?, reasoning, starts_in_reasoning)
                .map_err(value_error)?;
        if let Some(s) = parse_schemas(tool_schemas)? {
            inner.set_tool_schemas(s);
        }
        Ok(PyOutputParser { inner })
    }

    #[getter]
    fn family(&self) -> Option<&'static str> {
        self.inner.family().map(Family::name)
    }

    #[getter]
    fn reasoning(&self) -> bool {
        self.inner.reasoning()
    }

    #[getter]
    fn starts_in_reasoning(&self) -> bool {
        self.inner.starts_in_reasoning()
    }

    /// Feeds text; returns the segments it completed.
    fn push(&mut self, py: Python<'_>, text: &str) -> Vec<PySegment> {
        let inner = &mut self.inner;
        wrap(detach_if(py, text.len() >= DETACH_BYTES, || {
            inner.push(text)
        }))
    }

    /// Ends the stream: the remaining segments; the parser is then reset.
    /// `cut=True`: generation was cut (max_tokens), so a tool call still
    /// open is dropped instead of coming back as text.
    #[pyo3(signature = (*, cut = false))]
    fn flush(&mut self, cut: bool) -> Vec<PySegment> {
        wrap(self.inner.finish(cut))
    }

    fn __repr__(&self) -> String {
        format!("OutputParser({})", settings_repr(&self.inner))
    }
}

/// Stop scan then output parsing, one call per decoded chunk.
#[pyclass(module = "mlx_cairn._core", name = "TextPipeline")]
pub struct PyTextPipeline {
    inner: core::TextPipeline,
    stops: Vec<Py<PyString>>,
}

#[pymethods]
impl PyTextPipeline {
    #[new]
    #[pyo3(signature = (stops, family = None, reasoning = false, starts_in_reasoning = false, *, tool_schemas = None))]
    fn new(
        py: Python<'_>,
        stops: Vec<String>,
        family: Option<&str>,
        reasoning: bool,
        starts_in_reasoning: bool,
        tool_schemas: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let mut inner = core::TextPipeline::new(
            &stops,
            parse_family(family)?,
            reasoning,
            starts_in_reasoning,
        )
        .map_err(value_error)?;
        if let Some(s) = parse_schemas(tool_schemas)? {
            inner.set_tool_schemas(s);
        }
        Ok(PyTextPipeline {
            inner,
            stops: stop_objs(py, &stops),
        })
    }

    #[getter]
    fn stops(&self) -> Vec<String> {
        self.inner.scanner().stops().to_vec()
    }

    #[getter]
    fn family(&self) -> Option<&'static str> {
        self.inner.parser().family().map(Family::name)
    }

    #[getter]
    fn reasoning(&self) -> bool {
        self.inner.parser().reasoning()
    }

    #[getter]
    fn starts_in_reasoning(&self) -> bool {
        self.inner.parser().starts_in_reasoning()
    }

    /// Feeds one chunk; returns (segments, matched stop or None).
    fn push(&mut self, py: Python<'_>, text: &str) -> (Vec<PySegment>, Option<Py<PyString>>) {
        let inner = &mut self.inner;
        let (segs, m) = detach_if(py, text.len() >= DETACH_BYTES, || inner.push(text));
        (wrap(segs), m.map(|i| self.stops[i].clone_ref(py)))
    }

    /// Ends the stream: the remaining segments; the pipeline is then reset.
    /// `cut=True`: generation was cut (max_tokens), so a tool call still
    /// open is dropped instead of coming back as text.
    #[pyo3(signature = (*, cut = false))]
    fn flush(&mut self, cut: bool) -> Vec<PySegment> {
        wrap(self.inner.finish(cut))
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "TextPipeline({}, {})",
            stops_repr(py, &self.stops)?,
            settings_repr(self.inner.parser())
        ))
    }
}

/// One-shot output parsing; equals the coalesced streamed result.
#[pyfunction]
#[pyo3(signature = (text, family = None, reasoning = false, starts_in_reasoning = false, *, tool_schemas = None))]
fn parse_output(
    py: Python<'_>,
    text: &str,
    family: Option<&str>,
    reasoning: bool,
    starts_in_reasoning: bool,
    tool_schemas: Option<&Bound<'_, PyAny>>,
) -> PyResult<Vec<PySegment>> {
    let f = parse_family(family)?;
    let schemas = parse_schemas(tool_schemas)?;
    let run = || -> Result<Vec<core::Segment>, TextError> {
        let mut p = core::OutputParser::new(f, reasoning, starts_in_reasoning)?;
        if let Some(s) = schemas {
            p.set_tool_schemas(s);
        }
        let mut segs = p.push(text);
        p.flush_into(&mut segs);
        Ok(segs)
    };
    let segs = detach_if(py, text.len() >= DETACH_BYTES, run);
    segs.map(wrap).map_err(value_error)
}

/// Every tag the parser for `family` reads (see `cairn_text::parser_tags`).
#[pyfunction]
#[pyo3(signature = (family = None, reasoning = false))]
fn parser_tags(family: Option<&str>, reasoning: bool) -> PyResult<Vec<&'static str>> {
    Ok(core::parser_tags(parse_family(family)?, reasoning))
}

/// Merges adjacent text (and adjacent reasoning) segments, drops empty ones.
#[pyfunction]
fn coalesce(segments: Vec<PyRef<'_, PySegment>>) -> Vec<PySegment> {
    wrap(core::OutputParser::coalesce(
        segments.iter().map(|s| s.inner.clone()),
    ))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySegment>()?;
    m.add_class::<PyStopScanner>()?;
    m.add_class::<PyOutputParser>()?;
    m.add_class::<PyTextPipeline>()?;
    m.add_function(wrap_pyfunction!(parse_output, m)?)?;
    m.add_function(wrap_pyfunction!(coalesce, m)?)?;
    m.add_function(wrap_pyfunction!(parser_tags, m)?)?;
    m.add("FAMILIES", Family::NAMES.to_vec())?;
    Ok(())
}

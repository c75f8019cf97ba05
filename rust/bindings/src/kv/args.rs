//! Argument conversion for the KV wrappers: counts, token ids, block ids and
//! salts from Python objects, with ValueError/TypeError for bad input.
use pyo3::buffer::{ElementType, PyUntypedBuffer};
use pyo3::exceptions::{PyOverflowError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::critical_section::with_critical_section;
use pyo3::types::{PyBytes, PyList, PyString, PyTuple};

/// A non-negative count from a Python int, as a ValueError when it is not.
pub(super) fn count_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
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

pub(super) fn int_item(item: &Bound<'_, PyAny>, hi: i64, what: &str) -> PyResult<u32> {
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
pub(super) fn int_seq(obj: &Bound<'_, PyAny>, hi: i64, what: &str) -> PyResult<Vec<u32>> {
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

pub(super) fn block_ids(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    int_seq(obj, i64::from(u32::MAX), "block id")
}

pub(super) fn salt_bytes(salt: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Vec<u8>>> {
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

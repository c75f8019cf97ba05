//! `mlx_cairn._core`: thin PyO3 wrappers over the pure Rust crates.
//!
//! Each submodule owns the classes of one crate and registers them here.
//! Rust errors are mapped to Python exceptions in these files only; nothing
//! may panic across the boundary.
use pyo3::marker::Ungil;
use pyo3::prelude::*;

mod blas;
mod constrain;
mod kv;
mod sse;
mod text;

/// Runs `work` with the GIL released when the input is `big` enough for
/// that to pay; small inputs (one token's text) run with it held.
fn detach_if<T: Ungil>(py: Python<'_>, big: bool, work: impl Ungil + FnOnce() -> T) -> T {
    if big {
        py.detach(work)
    } else {
        work()
    }
}

#[pymodule(gil_used = false)]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    text::register(m)?;
    sse::register(m)?;
    kv::register(m)?;
    constrain::register(m)?;
    Ok(())
}

//! `mlx_cairn._core`: thin PyO3 wrappers over the pure Rust crates.
//!
//! Each submodule owns the classes of one crate and registers them here.
//! Rust errors are mapped to Python exceptions in these files only; nothing
//! may panic across the boundary.
use pyo3::prelude::*;

mod blas;
mod constrain;
mod kv;
mod sse;
mod text;

#[pymodule(gil_used = false)]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    text::register(m)?;
    sse::register(m)?;
    kv::register(m)?;
    constrain::register(m)?;
    Ok(())
}

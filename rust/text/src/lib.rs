//! cairn-text: see DESIGN.md §3. Pure Rust, no pyo3.

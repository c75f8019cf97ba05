//! cairn-kv: see DESIGN.md §3. Pure Rust, no pyo3.

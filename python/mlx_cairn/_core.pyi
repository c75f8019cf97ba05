"""Type stubs for the private extension `mlx_cairn._core` (checked by mypy.stubtest).

Users import the facades `mlx_cairn.text`, `mlx_cairn.sse` and `mlx_cairn.kv`.
"""

__version__: str

# ---------------------------------------------------------------------------
# text: stop-sequence scanner and output parser (rust/text, bindings/src/text.rs)
# ---------------------------------------------------------------------------

# (end of text section)

# ---------------------------------------------------------------------------
# sse: SSE frame encoder / decoder (rust/sse, bindings/src/sse.rs)
# ---------------------------------------------------------------------------

# (end of sse section)

# ---------------------------------------------------------------------------
# kv: block pool and prefix cache (rust/kv, bindings/src/kv.rs)
# ---------------------------------------------------------------------------

# (end of kv section)

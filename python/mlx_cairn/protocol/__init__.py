"""mlx_cairn.protocol (see docs/design.md §1)."""

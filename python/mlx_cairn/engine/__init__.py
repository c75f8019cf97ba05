"""mlx_cairn.engine (see DESIGN.md §1)."""

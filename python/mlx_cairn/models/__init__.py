"""mlx_cairn.models (see DESIGN.md §1)."""

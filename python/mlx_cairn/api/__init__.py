"""mlx_cairn.api (see DESIGN.md §1)."""

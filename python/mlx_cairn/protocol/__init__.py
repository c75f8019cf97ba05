"""mlx_cairn.protocol (see DESIGN.md §1)."""

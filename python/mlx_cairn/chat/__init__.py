"""mlx_cairn.chat (see DESIGN.md §1)."""

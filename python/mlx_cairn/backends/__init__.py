"""Where MLX runs: the seams for one compute backend each (docs/design.md §2, §5).

MLX itself picks Metal, CUDA or the CPU; a package here holds only what one
backend needs on top of it. Today that is :mod:`mlx_cairn.backends.cpu`, the
speed-ups for MLX's CPU backend; Metal and CUDA need nothing, so the model and
engine code reads the same everywhere. Nothing in this package imports
``mlx.core`` at import time: :mod:`~mlx_cairn.backends.cpu.blas` must run first.
"""

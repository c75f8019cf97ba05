"""MLX's CPU backend made fast enough to serve: every speed-up, installed from here.

MLX on a CPU computes in fp32 and, as shipped, calls a reference BLAS and
unfused kernels (docs/design.md §5). Four measures close the gap, each in one
module, each with an environment switch to turn it off:

- :mod:`~mlx_cairn.backends.cpu.blas`: OpenBLAS (and our decode GEMM in front
  of it) loaded before ``mlx.core``; ``mlx_cairn/__init__.py`` calls
  :func:`~mlx_cairn.backends.cpu.blas.ensure` first thing;
- :mod:`~mlx_cairn.backends.cpu.layout`: dense weights laid out for the few
  rows of a decode step;
- :mod:`~mlx_cairn.backends.cpu.attention`: softmax attention as one kernel;
- :mod:`~mlx_cairn.backends.cpu.kernels`: ``exp``-based activations.

A loader calls :func:`install` once a model's weights are final; on Metal and
CUDA it does nothing. Importing this package does not import ``mlx.core``.

Example::

    from mlx_cairn.backends import cpu
    cpu.install(model, compute)        # a no-op unless fp32 on the CPU
"""

from __future__ import annotations

from typing import Any


def applies(compute: Any) -> bool:
    """True when MLX computes in ``compute`` (an ``mx.Dtype``) on the CPU in fp32."""
    import mlx.core as mx

    return bool(compute == mx.float32 and mx.default_device() == mx.cpu)


def install(
    model: Any,
    compute: Any,
    *,
    prefix: str = "mlx_lm.models.",
    layout: bool = True,
    activations: bool = True,
) -> bool:
    """Install the CPU speed-ups on a loaded mlx-lm (or mlx-vlm) ``model``.

    Args:
        compute: the model's compute dtype; nothing happens unless :func:`applies`.
        prefix: the package whose modules' attention function is routed.
        layout: re-lay dense linears for decode (embedding encoders skip it).
        activations: patch the ``exp``-based activations (mlx-lm modules only).

    Returns:
        Whether anything was installed.
    """
    if not applies(compute):
        return False
    from mlx_cairn.backends.cpu import attention, kernels
    from mlx_cairn.backends.cpu import layout as weight_layout

    if layout:
        weight_layout.apply_cpu_layout_generic(model)
    attention.install(model, prefix=prefix)
    if activations:
        kernels.install(model)
    return True

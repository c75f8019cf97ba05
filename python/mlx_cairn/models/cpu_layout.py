"""A weight layout for fast single-token decode on the CPU backend (OpenBLAS).

MLX computes ``x @ W.T`` with ``cblas_sgemm``. For one-token decode (M = 1)
OpenBLAS 0.3.21 is much slower on wide matrices (out > in) in the ``W.T``
layout than on the same weights stored transposed and cut into column
blocks of at most :data:`CHUNK` outputs::

    W [out, in]  ->  Wt_0 [in, <=CHUNK] | Wt_1 [in, <=CHUNK] | ...
    y = concat(x @ Wt_0, x @ Wt_1, ...)

Measured here (bench/RESULTS.md): the MLP gate/up projections of SmolLM2
take about 2.4x less CPU time and the 49152-wide LM head about 1.7x less;
narrow or square matrices are as fast or faster as they are, so they stay.
Results are identical up to float summation order. Set ``CAIRN_CPU_LAYOUT=0``
to keep the plain layout.
"""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

#: Output columns per block (best of 256..4096 on this machine's OpenBLAS).
CHUNK = 768


class BlockedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` stored as transposed column blocks."""

    def __init__(self, weight: mx.array, bias: mx.array | None = None, chunk: int = CHUNK) -> None:
        super().__init__()
        self.blocks = [
            mx.contiguous(weight[i : i + chunk].T) for i in range(0, weight.shape[0], chunk)
        ]
        if bias is not None:
            self.bias = bias

    def __call__(self, x: mx.array) -> mx.array:
        parts = [x @ w for w in self.blocks]
        y = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
        return y + self.bias if "bias" in self else y

    @property
    def weight(self) -> mx.array:
        """The weight back in the usual ``[out, in]`` layout."""
        return mx.concatenate(self.blocks, axis=1).T


def enabled() -> bool:
    return os.environ.get("CAIRN_CPU_LAYOUT", "1") != "0"


def apply_cpu_layout(model: nn.Module) -> int:
    """Re-lay wide dense fp32 linears (and the LM head) as :class:`BlockedLinear`; returns how many."""
    changed = 0
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.children().items()):
                if type(child) is nn.Linear and child.weight.dtype == mx.float32:
                    out_dim, in_dim = child.weight.shape
                    if out_dim > in_dim:
                        bias = child.bias if "bias" in child else None
                        setattr(parent, name, BlockedLinear(child.weight, bias))
                        changed += 1
    head = (
        model.model.embed_tokens.weight if model.args.tie_word_embeddings else model.lm_head.weight
    )
    if head.dtype == mx.float32 and type(getattr(model, "lm_head", nn.Linear(1, 1))) is nn.Linear:
        # Tied embeddings keep the [vocab, hidden] table for lookups; the head gets its own copy.
        model.head = BlockedLinear(head)
        if not model.args.tie_word_embeddings:
            del model.lm_head
        changed += 1
    mx.eval(model.parameters())
    return changed


def hf_parameters(model: nn.Module) -> dict[str, mx.array]:
    """The model's parameters under HF names and layout, whatever layout it runs in."""
    out: dict[str, mx.array] = {}
    flat: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    for k, v in flat:
        if ".blocks." in k or k.startswith("head."):
            continue
        out[k] = v
    for name, mod in model.named_modules():
        if isinstance(mod, BlockedLinear):
            if name == "head":
                if model.args.tie_word_embeddings:
                    continue
                name = "lm_head"
            out[f"{name}.weight"] = mod.weight
            if "bias" in mod:
                out[f"{name}.bias"] = mod.bias
    return out

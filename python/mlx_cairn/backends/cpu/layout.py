"""A weight layout for fast decode on the CPU backend (OpenBLAS).

MLX computes ``x @ W.T`` with ``cblas_sgemm``. For the few rows of a decode
step OpenBLAS 0.3.21 is much slower on the weights in that ``W.T`` layout
than on the same weights stored transposed, ``Wt [in, out]`` contiguous, so
that the product is a plain ``x @ Wt``. :class:`BlockedLinear` stores them so
(optionally cut into column blocks of ``chunk`` outputs, concatenated back)::

    W [out, in]  ->  Wt_0 [in, <=chunk] | Wt_1 [in, <=chunk] | ...
    y = concat(x @ Wt_0, x @ Wt_1, ...)

Measured here (bench/RESULTS.md, "Decode weights stored transposed"), 30
layers' products streamed from memory, ms, plain / 768-column blocks / one
transposed block: the 49152-wide LM head 27.2 / 24.7 / 19.6 at 8 rows and
19.3 / 15.1 / 10.5 at one; the 60 gate/up projections 52.4 / 48.0 / 35.9 at
8 rows; the narrow ones (down, q, o) 10-20% faster transposed; k/v level.
A whole decode step: 13-16% faster at 1, 8 and 16 rows. One block (the
default, ``chunk`` None) is the fastest at every row count measured; the
768-column blocks of earlier commits are kept as an option. Results are
identical up to float summation order.

Which layout is faster depends on the machine (core count, OpenBLAS build,
what else runs), so by default :func:`apply_cpu_layout` measures products
over the model's own weights at load (~0.3 s) and keeps the transposed
layout, per group (wide linears, narrow ones, the head), only where it wins.
``CAIRN_CPU_LAYOUT=1`` forces it, ``0`` turns it off.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

#: Output columns per block; None: the whole matrix is one block (the fastest here).
CHUNK: int | None = None


class BlockedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` stored as transposed column blocks."""

    def __init__(
        self, weight: mx.array, bias: mx.array | None = None, chunk: int | None = CHUNK
    ) -> None:
        super().__init__()
        chunk = chunk or weight.shape[0]
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


def mode() -> str:
    """``CAIRN_CPU_LAYOUT``: "auto" (default: measure, keep what is faster), "1" (always), "0" (never)."""
    value = os.environ.get("CAIRN_CPU_LAYOUT", "auto").lower()
    return {"0": "off", "off": "off", "1": "on", "on": "on"}.get(value, "auto")


def enabled() -> bool:
    return mode() != "off"


#: Rows of the products :func:`apply_cpu_layout` times (one stream; a batch of decode rows).
_MEASURED_ROWS = (1, 8)


def _matvec_seconds(
    weights: list[mx.array], blocked: list[BlockedLinear] | None, reps: int
) -> float:
    """Best wall time of decode-sized products over all ``weights`` (streamed from memory,
    not cache), summed over :data:`_MEASURED_ROWS`."""
    total = 0.0
    for rows in _MEASURED_ROWS:
        xs = {d: mx.ones((rows, d), dtype=mx.float32) for d in {w.shape[1] for w in weights}}
        mx.eval(list(xs.values()))
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            if blocked is None:
                mx.eval([xs[w.shape[1]] @ w.T for w in weights])
            else:
                mx.eval([b(xs[w.shape[1]]) for b, w in zip(blocked, weights, strict=True)])
            best = min(best, time.perf_counter() - t)
        total += best
    return total


def _worth_it(
    weights: list[mx.array], blocked: list[BlockedLinear], how: str, reps: int = 3
) -> bool:
    """Whether the blocked layout is the one to keep: always ("on"), or measured ("auto")."""
    if how == "on":
        return True
    # A third of a layer group still streams from memory (tens of MB), at a third of the time.
    n = max(1, len(weights) // 3)
    plain = _matvec_seconds(weights[:n], None, reps)
    fast = _matvec_seconds(weights[:n], blocked[:n], reps)
    # Where the layouts are level either choice costs nothing; where one loses
    # (10-40% here), best-of-3 timings do not flip.
    return fast < plain


#: Where a re-laid linear goes (its parent's attribute), and the linear.
_Found = tuple[Callable[[BlockedLinear], object], nn.Linear]


def _relay_layers(found: list[_Found], how: str) -> int:
    """Re-lay the layers' dense fp32 linears, wide (out > in) and narrow ones as two
    groups, each kept whole or not at all (measured, unless ``how`` is "on")."""
    changed = 0
    for group in (
        [f for f in found if f[1].weight.shape[0] > f[1].weight.shape[1]],
        [f for f in found if f[1].weight.shape[0] <= f[1].weight.shape[1]],
    ):
        if not group:
            continue
        blocked = [BlockedLinear(c.weight, c.bias if "bias" in c else None) for _, c in group]
        mx.eval([b.parameters() for b in blocked])
        if _worth_it([c.weight for _, c in group], blocked, how):
            for (put, _), b in zip(group, blocked, strict=True):
                put(b)
            changed += len(group)
    return changed


def _relaid_head(weight: mx.array, how: str) -> BlockedLinear | None:
    """The head ``weight`` [vocab, hidden] re-laid, where that is the layout to keep."""
    blocked = BlockedLinear(weight)
    mx.eval(blocked.parameters())
    return blocked if _worth_it([weight], [blocked], how) else None


def _is_dense(child: object) -> bool:
    return type(child) is nn.Linear and child.weight.dtype == mx.float32


def apply_cpu_layout(model: nn.Module, how: str | None = None) -> int:
    """Re-lay the dense fp32 linears and the LM head as :class:`BlockedLinear`.

    ``how``: "on" always, "auto" (default from :func:`mode`) keeps each group
    (the layers' wide linears; their narrow ones; the head) only where
    decode-sized products measure faster on this machine. Returns the number
    of modules changed.
    """
    how = how or mode()
    if how == "off":
        return 0
    found: list[_Found] = [
        (functools.partial(setattr, parent, name), child)
        for layer in model.model.layers
        for parent in (layer.self_attn, layer.mlp)
        for name, child in parent.children().items()
        if _is_dense(child)
    ]
    changed = _relay_layers(found, how)

    tied = model.args.tie_word_embeddings
    head: mx.array | None = None
    if "head" not in model:
        if tied:
            head = model.model.embed_tokens.weight
        elif type(model.lm_head) is nn.Linear:
            head = model.lm_head.weight
    if head is not None and head.dtype == mx.float32:
        # Tied embeddings keep the [vocab, hidden] table for lookups; the head gets its own copy.
        blocked_head = _relaid_head(head, how)
        if blocked_head is not None:
            model.head = blocked_head
            if not tied:
                del model.lm_head
            changed += 1
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


class BlockedTiedEmbedding(nn.Module):
    """A tied embedding whose ``as_linear`` (the LM head) runs on blocked transposed copies.

    Lookups read ``weight`` as ``nn.Embedding`` does; mlx-lm's heads call
    ``embed_tokens.as_linear(h)`` for tied models, so the head's layout changes
    without touching the architecture code.
    """

    def __init__(self, weight: mx.array, head: BlockedLinear) -> None:
        super().__init__()
        self.weight = weight
        self.head = head

    def __call__(self, x: mx.array) -> mx.array:
        return self.weight[x]

    def as_linear(self, x: mx.array) -> mx.array:
        return self.head(x)


def apply_cpu_layout_generic(model: nn.Module, how: str | None = None) -> int:
    """:func:`apply_cpu_layout` for any mlx-lm model: the dense fp32 linears of its
    ``layers`` and its LM head (``lm_head``, or a tied ``embed_tokens``), where they
    measure faster. Returns the number of modules changed."""

    how = how or mode()
    if how == "off":
        return 0
    found: list[_Found] = [
        (functools.partial(_put_path, layer, path), child)
        for layer in getattr(model, "layers", None) or []
        for path, child in layer.named_modules()
        if _is_dense(child)
    ]
    changed = _relay_layers(found, how)
    head = model.get("lm_head") if isinstance(model, nn.Module) else None
    backbone = model.get("model")
    embed = backbone.get("embed_tokens") if isinstance(backbone, nn.Module) else None
    if type(head) is nn.Linear and head.weight.dtype == mx.float32 and "bias" not in head:
        blocked_head = _relaid_head(head.weight, how)
        if blocked_head is not None:
            model.lm_head = blocked_head
            changed += 1
    elif (
        head is None
        and isinstance(backbone, nn.Module)
        and type(embed) is nn.Embedding
        and embed.weight.dtype == mx.float32
    ):
        blocked_head = _relaid_head(embed.weight, how)
        if blocked_head is not None:
            backbone.embed_tokens = BlockedTiedEmbedding(embed.weight, blocked_head)
            changed += 1
    return changed


def _put_path(layer: nn.Module, path: str, module: nn.Module) -> None:
    layer.update_modules(tree_unflatten([(path, module)]))


def dense_parameters(model: nn.Module) -> dict[str, mx.array]:
    """An mlx-lm model's parameters under their usual names, whatever layout it runs in."""
    out: dict[str, mx.array] = {}
    flat: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    for k, v in flat:
        if ".blocks." in k or k.startswith("blocks.") or ".head.blocks." in k:
            continue
        out[k] = v
    for name, mod in model.named_modules():
        if isinstance(mod, BlockedLinear) and not name.endswith(".head"):
            out[f"{name}.weight"] = mod.weight
            if "bias" in mod:
                out[f"{name}.bias"] = mod.bias
    return out

"""The contract between architectures and KV caches.

An architecture never knows how its keys and values are stored. A forward
call gets a batch of B rows, each holding L new tokens, and a cache object:

    tokens   [B, L] int32            new tokens of each row
    cache.offsets  [B] int32          position of each row's first new token
                                      (RoPE offset; row b covers positions
                                       offsets[b] .. offsets[b] + L - 1)

In every attention layer the architecture projects q, k, v, applies RoPE at
``cache.offsets``, then calls::

    k_all, v_all, mask = cache.update_and_fetch(layer_idx, k, v)
    #   k, v:         [B, n_kv_heads, L, head_dim]   the new rows
    #   k_all, v_all: [B, n_kv_heads, T, head_dim]   everything to attend over
    #   mask:         None | "causal" | array broadcastable to [B, n_heads, L, T]
    out = mx.fast.scaled_dot_product_attention(q, k_all, v_all, scale=..., mask=mask)

The contiguous cache (one sequence, the reference loop) and the paged cache
(engine: many sequences over block pools, docs/design.md §4) both implement it, so
the architecture code is shared and untouched by paging.

A model returns hidden states; ``model.logits(h)`` applies the final head, so
callers compute logits only where they need them (the last position)::

    h = model(tokens, cache)            # [B, L, hidden]
    logits = model.logits(h[:, -1, :])  # [B, vocab]

mlx-lm architectures (models/zoo.py) instead take one cache object per layer,
``cache.layer_caches(model)``, each with mlx-lm's cache interface (``offset``,
``update_and_fetch(k, v)``, ``make_mask(N, window_size=...)``). The engine
sizes its pools from ``model.layer_specs`` (:class:`LayerSpec` per layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    import mlx.core as mx

Mask = "mx.array | Literal['causal'] | None"


class KVCache(Protocol):
    """What an architecture sees of the KV cache during one forward call."""

    @property
    def offsets(self) -> mx.array:
        """[B] int32: position of each row's first new token."""
        ...

    def update_and_fetch(
        self, layer: int, keys: mx.array, values: mx.array
    ) -> tuple[mx.array, mx.array, mx.array | Literal["causal"] | None]:
        """Store this step's keys/values for ``layer``; return all keys,
        all values and the attention mask for this step."""
        ...


class Model(Protocol):
    """A causal LM over a :class:`KVCache`."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    def __call__(self, tokens: mx.array, cache: KVCache) -> mx.array:
        """Hidden states [B, L, hidden] for ``tokens`` [B, L]."""
        ...

    def logits(self, hidden: mx.array) -> mx.array:
        """Final norm + LM head: [..., hidden] -> [..., vocab] (fp32)."""
        ...


@dataclass(frozen=True)
class StateEntry:
    """One array of a recurrent layer's per-sequence state (shape without the batch axis)."""

    shape: tuple[int, ...]
    dtype: mx.Dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.size
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class LayerSpec:
    """What one layer caches: the shape of its pools and what it attends to.

    ``kv_heads`` x ``k_dim`` keys and ``kv_heads`` x ``v_dim`` values per token
    (MLA layers cache a latent: one "head" whose key and value widths differ).
    ``window``: a sliding-window layer's query sees the last ``window``
    positions, itself included; None for global attention.

    ``state``: a recurrent layer's fixed-size per-sequence state (mlx-lm's
    ``ArraysCache`` entries: conv state, SSM / delta-rule state), kept in
    state slots instead of blocks. A pure recurrent layer has ``kv_heads == 0``;
    a layer may have both (Falcon-H1's parallel attention + Mamba).
    """

    kv_heads: int
    k_dim: int
    v_dim: int
    window: int | None = None
    state: tuple[StateEntry, ...] = ()

    @property
    def has_kv(self) -> bool:
        return self.kv_heads > 0

    def bytes_per_token(self, itemsize: int) -> int:
        return self.kv_heads * (self.k_dim + self.v_dim) * itemsize

    @property
    def state_bytes(self) -> int:
        return sum(e.nbytes for e in self.state)

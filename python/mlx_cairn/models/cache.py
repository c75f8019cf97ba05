"""A contiguous KV cache for one sequence: the reference the paged cache is tested against.

Each layer keeps one growing buffer per K and V::

    keys[layer]  [1, kv_heads, capacity, head_dim]
                  |<---- length ---->|<- spare ->|

Buffers grow in steps of :attr:`ContiguousKVCache.step` tokens so a decode
step writes in place instead of concatenating.

For mlx-lm architectures (:class:`mlx_cairn.models.zoo.ZooModel`) the same
object hands out mlx-lm's own per-layer caches (``KVCache``,
``RotatingKVCache`` for sliding-window layers) through :meth:`layer_caches`,
so the reference loop runs exactly mlx-lm's single-sequence semantics.
"""

from __future__ import annotations

from typing import Any, Literal

import mlx.core as mx


class ContiguousKVCache:
    """Implements :class:`mlx_cairn.models.base.KVCache` for a batch of one row.

    Every layer counts its own length; :attr:`offsets` reports the last
    layer's, which only moves when that layer stores the step, so all layers
    of one forward call see the same RoPE offset.
    """

    step = 256

    def __init__(self, num_layers: int) -> None:
        self.keys: list[mx.array | None] = [None] * num_layers
        self.values: list[mx.array | None] = [None] * num_layers
        self._lens = [0] * num_layers
        self._offsets_for = -1
        self._offsets = mx.array([0], dtype=mx.int32)
        self._mlx: list[Any] | None = None

    def layer_caches(self, model: Any) -> list[Any]:
        """mlx-lm's per-layer caches for ``model`` (made by ``model.make_cache()`` on first use)."""
        if self._mlx is None:
            self._mlx = model.make_cache()
        return self._mlx

    @property
    def offset(self) -> int:
        """Number of tokens stored (the position of the next token)."""
        if self._mlx is not None:
            return int(self._mlx[0].offset)
        return self._lens[-1]

    @property
    def offsets(self) -> mx.array:
        if self._offsets_for != self._lens[-1]:
            self._offsets_for = self._lens[-1]
            self._offsets = mx.array([self._offsets_for], dtype=mx.int32)
        return self._offsets

    def update_and_fetch(
        self, layer: int, keys: mx.array, values: mx.array
    ) -> tuple[mx.array, mx.array, Literal["causal"] | None]:
        B, H, L, D = keys.shape
        if B != 1:
            raise ValueError(f"ContiguousKVCache holds one sequence, got a batch of {B}")
        prev = self._lens[layer]
        end = prev + L
        k_buf, v_buf = self.keys[layer], self.values[layer]
        if k_buf is None or end > k_buf.shape[2]:
            grow = ((end + self.step - 1) // self.step) * self.step
            new_k = mx.zeros((1, H, grow, D), dtype=keys.dtype)
            new_v = mx.zeros((1, H, grow, values.shape[3]), dtype=values.dtype)
            if k_buf is not None and v_buf is not None and prev:
                new_k[:, :, :prev, :] = k_buf[:, :, :prev, :]
                new_v[:, :, :prev, :] = v_buf[:, :, :prev, :]
            k_buf, v_buf = new_k, new_v
        assert v_buf is not None
        k_buf[:, :, prev:end, :] = keys
        v_buf[:, :, prev:end, :] = values
        self.keys[layer], self.values[layer] = k_buf, v_buf
        self._lens[layer] = end
        # New rows attend to everything before them and causally among
        # themselves; MLX aligns "causal" to the bottom-right corner.
        mask: Literal["causal"] | None = "causal" if L > 1 else None
        return k_buf[:, :, :end, :], v_buf[:, :, :end, :], mask

    def trim(self, n: int) -> None:
        """Forget the last ``n`` tokens of every layer."""
        self._lens = [max(0, x - n) for x in self._lens]
        for c in self._mlx or []:
            c.trim(n)

    @property
    def state(self) -> list[mx.array]:
        """Buffers to ``mx.eval`` so lazy writes do not pile up."""
        out = [b for b in (*self.keys, *self.values) if b is not None]
        for c in self._mlx or []:
            out.extend(a for a in c.state if isinstance(a, mx.array))
        return out

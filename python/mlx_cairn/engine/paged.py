"""Paged KV pools on MLX and the per-step cache view the architectures call (DESIGN.md §4).

Each layer owns a K pool and a V pool shaped ``[num_blocks, block_size,
kv_heads, head_dim]``. A sequence's KV lives in the blocks of its block table
(ids from the Rust ``BlockPool``; block 0 is the reserved null block)::

    position p of a sequence  ->  block  table[p // block_size]
                                  row    p %  block_size

One forward call covers B rows of L new tokens each. :class:`PagedKVCache`
writes the new K/V rows at their slots, then gathers each row's blocks into
a contiguous ``[B, kv_heads, T, head_dim]`` view (T = the longest row's block
count x block_size; shorter rows are padded with the null block and masked)
for ``mx.fast.scaled_dot_product_attention``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence as Seq

import mlx.core as mx
import numpy as np

from mlx_cairn.models.base import LayerSpec

#: Fraction of available memory the default pool may take.
DEFAULT_MEMORY_FRACTION = 0.25
#: The default pool stays under this, unless one full context alone needs more.
DEFAULT_MAX_BYTES = 2 << 30
#: Never leave less than this fraction of available memory when sizing explicitly.
MAX_MEMORY_FRACTION = 0.9


def available_memory_bytes() -> int:
    """Memory the KV pools may still take: free device memory, else MemAvailable."""
    try:
        if mx.default_device() == mx.gpu and hasattr(mx, "device_info"):
            info = mx.device_info()
            total = int(info.get("max_recommended_working_set_size", info.get("memory_size", 0)))
            if total:
                return max(0, total - int(mx.get_active_memory()))
    except Exception:  # pragma: no cover - backend without device info
        pass
    if sys.platform == "linux":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:  # pragma: no cover
            pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # pragma: no cover
        return 4 << 30


def pool_blocks(
    per_block: int,
    *,
    num_blocks: int | None,
    kv_cache_gb: float | None,
    default_tokens: int,
    block_size: int,
    context_tokens: int = 0,
) -> int:
    """Number of blocks for the pools: explicit, from a GiB budget, or a default.

    The default is the smallest of: ``default_tokens`` (e.g. max_batch full
    contexts), :data:`DEFAULT_MAX_BYTES` (raised to ``context_tokens`` when one
    full context needs more) and :data:`DEFAULT_MEMORY_FRACTION` of available
    memory. Raises ValueError when the pool would not fit in available memory
    or is too small.
    """
    avail = available_memory_bytes()
    if num_blocks is not None:
        want = int(num_blocks)
    elif kv_cache_gb is not None:
        if not (isinstance(kv_cache_gb, (int, float)) and kv_cache_gb > 0):
            raise ValueError(f"kv_cache_gb must be positive, got {kv_cache_gb!r}")
        want = int(kv_cache_gb * (1 << 30)) // per_block
    else:
        enough = -(-default_tokens // block_size) + 1  # + the null block
        one_context = -(-context_tokens // block_size) + 1
        cap = max(DEFAULT_MAX_BYTES // per_block, one_context)
        want = min(int(avail * DEFAULT_MEMORY_FRACTION) // per_block, enough, cap)
    if want < 2:
        raise ValueError(
            f"KV pool of {want} blocks is too small ({per_block} bytes per block, "
            f"{avail / 2**30:.1f} GiB available)"
        )
    if want * per_block > avail * MAX_MEMORY_FRACTION:
        raise ValueError(
            f"KV pool of {want * per_block / 2**30:.2f} GiB does not fit in the "
            f"{avail / 2**30:.2f} GiB of available memory"
        )
    return want


class KVPools:
    """Per-layer K/V block pools (MLX arrays), sized once, never grown.

    Layer ``i`` owns ``k[i]`` ``[num_blocks, block_size, kv_heads, k_dim]`` and
    ``v[i]`` ``[num_blocks, block_size, kv_heads, v_dim]`` from ``layers[i]``.
    Every layer has every block, so one block id means the same positions in
    all layers. ``layers`` may be omitted for a uniform model
    (``num_layers`` x ``num_kv_heads`` x ``head_dim``).
    """

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        dtype: mx.Dtype = mx.float32,
        layers: Seq[LayerSpec] | None = None,
        num_layers: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (block 0 is reserved), got {num_blocks}"
            )
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if layers is None:
            if num_layers is None or num_kv_heads is None or head_dim is None:
                raise ValueError("give layers, or num_layers, num_kv_heads and head_dim")
            layers = [LayerSpec(num_kv_heads, head_dim, head_dim)] * num_layers
        self.layers = tuple(layers)
        self.num_layers = len(self.layers)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.reset()

    def reset(self) -> None:
        """Fresh zeroed pools (pending writes to the old ones are dropped)."""
        n, bs = self.num_blocks, self.block_size
        self.k = [mx.zeros((n, bs, s.kv_heads, s.k_dim), dtype=self.dtype) for s in self.layers]
        self.v = [mx.zeros((n, bs, s.kv_heads, s.v_dim), dtype=self.dtype) for s in self.layers]
        mx.eval(self.k, self.v)  # commit the memory now, not at the first step

    @staticmethod
    def bytes_per_block(
        num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, itemsize: int
    ) -> int:
        """K + V bytes one block takes across ``num_layers`` uniform layers."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

    @staticmethod
    def block_bytes(layers: Seq[LayerSpec], block_size: int, itemsize: int) -> int:
        """K + V bytes one block takes across ``layers``."""
        return block_size * sum(s.bytes_per_token(itemsize) for s in layers)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)

    def arrays(self) -> list[mx.array]:
        """Every pool array (to evaluate after a step)."""
        return [*self.k, *self.v]


class _View:
    """Which blocks one kind of layer gathers in a step, and the key positions they hold."""

    __slots__ = ("key_pos", "tables")

    def __init__(self, tables: mx.array, key_pos: np.ndarray) -> None:
        self.tables = tables  # [B, nblk] int32 block ids (0 = null block)
        self.key_pos = key_pos  # [B or 1, nblk * block_size] absolute position of each key


class PagedKVCache:
    """One forward call's view of the pools: B ragged rows, per-layer mlx-lm caches.

    Rows may carry fewer than L new tokens (``lengths``): their tail is padding
    whose K/V go to the null block and whose outputs the caller ignores::

        row 0:  t t t t t      lengths[0] = 5
        row 1:  t t . . .      lengths[1] = 2   ('.' = pad, written to block 0)

    ``layers[i]`` is what mlx-lm's attention code gets as layer i's cache
    (:class:`PagedLayerCache`). Global layers gather each row's whole block
    table; a sliding-window layer gathers, per row, only the blocks its
    queries can see::

        row b, window w, first query at position o = offsets[b]
        first block gathered = max(0, o - w + 1) // block_size

    Args:
        pools: the KV pools.
        block_tables: per row, the block ids covering positions
            ``0 .. offsets[b] + lengths[b] - 1`` (already allocated).
        offsets: per row, the position of its first new token.
        lengths: new tokens per row (an int: the same L for every row).
    """

    def __init__(
        self,
        pools: KVPools,
        block_tables: Seq[Seq[int]],
        offsets: Seq[int],
        lengths: int | Seq[int],
    ) -> None:
        bs = pools.block_size
        self.pools = pools
        batch = len(block_tables)
        lens = np.full(batch, lengths) if isinstance(lengths, int) else np.asarray(lengths)
        length = int(lens.max())
        offs = np.asarray(offsets, dtype=np.int64)
        ctx = offs + lens  # tokens each row attends to
        # Blocks up to the last (padded) query, so every query sees at least itself.
        nblk = int(((offs + length + bs - 1) // bs).max())
        tables = np.zeros((batch, nblk), dtype=np.int32)  # pad with the null block
        for b, t in enumerate(block_tables):
            need = (int(ctx[b]) + bs - 1) // bs
            if len(t) < need:
                raise ValueError(f"row {b}: {len(t)} blocks cannot hold {int(ctx[b])} tokens")
            tables[b, :need] = t[:need]
        self._np_tables = tables
        self._np_offs = offs
        self._length = length
        # Write slots of the new tokens, row-major over [B, L]; padding -> block 0.
        steps = np.arange(length)[None, :]
        pos = offs[:, None] + steps
        self._q_pos = pos
        real = steps < lens[:, None]
        w_block = np.where(real, np.take_along_axis(tables, pos // bs, axis=1), 0)
        self._w_block = mx.array(w_block.reshape(-1).astype(np.int32))
        self._w_row = mx.array((pos % bs).reshape(-1).astype(np.int32))
        self._offsets = mx.array(offs.astype(np.int32))
        self._views: dict[int | None, _View] = {
            None: _View(mx.array(tables), np.arange(nblk * bs)[None, :])
        }
        self._masks: dict[tuple[int | None, int | None], mx.array] = {}
        # On the CPU, attention over the transposed gather view costs about twice
        # as much as one copy into [B, kvh, T, hd] plus attention over that
        # (bench/RESULTS.md, Engine section).
        self._contiguous = mx.default_device() == mx.cpu
        #: Per-layer caches in the interface mlx-lm's architectures call.
        self.layers = [PagedLayerCache(self, i, s.window) for i, s in enumerate(pools.layers)]

    @property
    def offsets(self) -> mx.array:
        """[B] int32: position of each row's first new token."""
        return self._offsets

    def layer_caches(self, model: object = None) -> list[PagedLayerCache]:
        """The per-layer caches to pass to an mlx-lm model."""
        return self.layers

    def view(self, window: int | None) -> _View:
        """The gather geometry of layers with sliding ``window`` (None: global)."""
        got = self._views.get(window)
        if got is not None:
            return got
        assert window is not None
        bs = self.pools.block_size
        full = self._np_tables
        nblk = full.shape[1]
        start = np.maximum(0, self._np_offs - window + 1) // bs  # [B] first block seen
        last = (self._np_offs + self._length - 1) // bs  # [B] block of the last (padded) query
        width = int((last - start).max()) + 1
        if width >= nblk:  # the window spans every block of some row
            view = self._views[None]
        else:
            idx = start[:, None] + np.arange(width)[None, :]  # [B, width]
            tables = np.where(
                idx < nblk, np.take_along_axis(full, np.minimum(idx, nblk - 1), axis=1), 0
            )
            key_pos = (idx[:, :, None] * bs + np.arange(bs)[None, None, :]).reshape(len(start), -1)
            view = _View(mx.array(tables.astype(np.int32)), key_pos)
        self._views[window] = view
        return view

    def mask(self, geometry: int | None, window: int | None) -> mx.array:
        """[B, 1, L, T] bool: key t visible to query i of row b (causal, within ``window``)."""
        key = (geometry, window)
        got = self._masks.get(key)
        if got is None:
            kp = self.view(geometry).key_pos[:, None, :]  # [B|1, 1, T]
            qp = self._q_pos[:, :, None]  # [B, L, 1]
            seen = kp <= qp
            if window is not None:
                seen &= kp > qp - window
            got = self._masks[key] = mx.array(seen[:, None, :, :])
        return got

    def write_and_gather(
        self, layer: int, geometry: int | None, keys: mx.array, values: mx.array
    ) -> tuple[mx.array, mx.array]:
        """Write ``keys``/``values`` [B, kvh, L, d] into layer's pools; gather its view."""
        p = self.pools
        b, h, n, dk = keys.shape
        dv = values.shape[3]
        # [B, kvh, L, d] -> [B*L, kvh, d], matching the row-major write slots.
        k_rows = _as(keys.transpose(0, 2, 1, 3).reshape(b * n, h, dk), p.dtype)
        v_rows = _as(values.transpose(0, 2, 1, 3).reshape(b * n, h, dv), p.dtype)
        # In-place scatter: the pool array is donated, nothing is copied.
        p.k[layer][self._w_block, self._w_row] = k_rows
        p.v[layer][self._w_block, self._w_row] = v_rows
        tables = self.view(geometry).tables
        # [B, nblk, bs, kvh, d] -> [B, kvh, nblk*bs, d]
        k_all = p.k[layer][tables].reshape(b, -1, h, dk).transpose(0, 2, 1, 3)
        v_all = p.v[layer][tables].reshape(b, -1, h, dv).transpose(0, 2, 1, 3)
        if self._contiguous and p.dtype == keys.dtype:  # (a cast below copies anyway)
            k_all, v_all = mx.contiguous(k_all), mx.contiguous(v_all)
        return _as(k_all, keys.dtype), _as(v_all, values.dtype)

    def update_and_fetch(
        self, layer: int, keys: mx.array, values: mx.array
    ) -> tuple[mx.array, mx.array, mx.array]:
        """The :mod:`mlx_cairn.models.base` contract: write, gather, and the causal mask."""
        k_all, v_all = self.write_and_gather(layer, None, keys, values)
        return k_all, v_all, self.mask(None, None)


class PagedLayerCache:
    """Layer ``i``'s cache as mlx-lm's attention code sees it (cf. ``mlx_lm`` ``BatchKVCache``).

    ``offset`` is the [B] array of each row's first new position (RoPE),
    ``update_and_fetch`` stores the step's keys/values in the pools and returns
    what the layer attends over, ``make_mask`` the matching ragged mask.
    """

    def __init__(self, owner: PagedKVCache, layer: int, window: int | None) -> None:
        self._owner = owner
        self.layer = layer
        self.window = window
        self._geometry = window

    @property
    def offset(self) -> mx.array:
        return self._owner.offsets

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self._owner.write_and_gather(self.layer, self._geometry, keys, values)

    def make_mask(
        self, N: int, window_size: int | None = None, return_array: bool = False, **kwargs: object
    ) -> mx.array:
        if self._owner._length != N:
            raise ValueError(f"mask for {N} queries, but the step has {self._owner._length}")
        window = window_size if window_size is not None else self.window
        return self._owner.mask(self._geometry, window)

    # The rest of mlx-lm's cache interface that model code or helpers may touch.
    def is_trimmable(self) -> bool:
        return False

    def size(self) -> int:
        return int(self._owner._np_offs.max()) + self._owner._length

    def empty(self) -> bool:
        return False

    @property
    def state(self) -> list[mx.array]:
        p = self._owner.pools
        return [p.k[self.layer], p.v[self.layer]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)


def _as(x: mx.array, dtype: mx.Dtype) -> mx.array:
    return x if x.dtype == dtype else x.astype(dtype)

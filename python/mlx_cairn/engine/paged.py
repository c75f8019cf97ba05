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
    """Per-layer K/V block pools (MLX arrays), sized once, never grown."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: mx.Dtype = mx.float32,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (block 0 is reserved), got {num_blocks}"
            )
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.reset()

    def reset(self) -> None:
        """Fresh zeroed pools (pending writes to the old ones are dropped)."""
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.k = [mx.zeros(shape, dtype=self.dtype) for _ in range(self.num_layers)]
        self.v = [mx.zeros(shape, dtype=self.dtype) for _ in range(self.num_layers)]
        mx.eval(self.k, self.v)  # commit the memory now, not at the first step

    @staticmethod
    def bytes_per_block(
        num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, itemsize: int
    ) -> int:
        """K + V bytes one block takes across all layers."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)

    def arrays(self) -> list[mx.array]:
        """Every pool array (to evaluate after a step)."""
        return [*self.k, *self.v]


class PagedKVCache:
    """The :class:`mlx_cairn.models.base.KVCache` view of one forward call over the pools.

    Rows may carry fewer than L new tokens (``lengths``): their tail is padding
    whose K/V go to the null block and whose outputs the caller ignores::

        row 0:  t t t t t      lengths[0] = 5
        row 1:  t t . . .      lengths[1] = 2   ('.' = pad, written to block 0)

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
        nblk = int(((offs + length + bs - 1) // bs).max())
        tables = np.zeros((batch, nblk), dtype=np.int32)  # pad with the null block
        for b, t in enumerate(block_tables):
            need = (int(ctx[b]) + bs - 1) // bs
            if len(t) < need:
                raise ValueError(f"row {b}: {len(t)} blocks cannot hold {int(ctx[b])} tokens")
            tables[b, :need] = t[:need]
        # Write slots of the new tokens, row-major over [B, L]; padding -> block 0.
        steps = np.arange(length)[None, :]
        pos = offs[:, None] + steps
        real = steps < lens[:, None]
        w_block = np.where(real, np.take_along_axis(tables, pos // bs, axis=1), 0)
        self._w_block = mx.array(w_block.reshape(-1).astype(np.int32))
        self._w_row = mx.array((pos % bs).reshape(-1).astype(np.int32))
        self._tables = mx.array(tables)
        # Mask [B, 1, L, T]: key t visible to query i of row b iff t <= offsets[b] + i.
        # (Pad queries see real keys too, so no row of the softmax is empty.)
        key_pos = np.arange(nblk * bs)[None, None, :]
        self._mask = mx.array((key_pos <= pos[:, :, None])[:, None, :, :])
        self._offsets = mx.array(offs.astype(np.int32))
        # On the CPU, attention over the transposed gather view costs about twice
        # as much as one copy into [B, kvh, T, hd] plus attention over that
        # (bench/RESULTS.md, Engine section).
        self._contiguous = mx.default_device() == mx.cpu

    @property
    def offsets(self) -> mx.array:
        """[B] int32: position of each row's first new token."""
        return self._offsets

    def update_and_fetch(
        self, layer: int, keys: mx.array, values: mx.array
    ) -> tuple[mx.array, mx.array, mx.array]:
        """Write ``keys``/``values`` [B, kvh, L, hd] into the pools; return the gathered view."""
        p = self.pools
        b, h, n, d = keys.shape
        # [B, kvh, L, hd] -> [B*L, kvh, hd], matching the row-major write slots.
        k_rows = _as(keys.transpose(0, 2, 1, 3).reshape(b * n, h, d), p.dtype)
        v_rows = _as(values.transpose(0, 2, 1, 3).reshape(b * n, h, d), p.dtype)
        # In-place scatter: the pool array is donated, nothing is copied.
        p.k[layer][self._w_block, self._w_row] = k_rows
        p.v[layer][self._w_block, self._w_row] = v_rows
        # [B, nblk, bs, kvh, hd] -> [B, kvh, nblk*bs, hd]
        k_all = p.k[layer][self._tables].reshape(b, -1, h, d).transpose(0, 2, 1, 3)
        v_all = p.v[layer][self._tables].reshape(b, -1, h, d).transpose(0, 2, 1, 3)
        if self._contiguous and p.dtype == keys.dtype:  # (a cast below copies anyway)
            k_all, v_all = mx.contiguous(k_all), mx.contiguous(v_all)
        return _as(k_all, keys.dtype), _as(v_all, values.dtype), self._mask


def _as(x: mx.array, dtype: mx.Dtype) -> mx.array:
    return x if x.dtype == dtype else x.astype(dtype)

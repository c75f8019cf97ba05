"""Paged KV pools on MLX and the per-step cache view the architectures call (docs/design.md §4).

Each layer owns a K pool and a V pool shaped ``[num_blocks, block_size,
kv_heads, head_dim]``. A sequence's KV lives in the blocks of its block table
(ids from the Rust ``BlockPool``; block 0 is the reserved null block)::

    position p of a sequence  ->  block  table[p // block_size]
                                  row    p %  block_size

One forward call covers B rows of L new tokens each. :class:`PagedKVCache`
writes the new K/V rows at their slots, then gathers each row's blocks into
a contiguous ``[B, kv_heads, T, head_dim]`` view (T = the longest row's block
count x block_size; shorter rows are padded with the null block and masked)
for ``mx.fast.scaled_dot_product_attention``. Decode calls over long contexts
skip that gather: consecutive ones over the same rows keep the gathered
arrays between steps and write each new position into them as well
(:class:`DecodeMirror`).

Recurrent layers (hybrids: Gated DeltaNet, Mamba, short convolutions) keep a
fixed-size state per sequence instead of KV rows. Their arrays live in state
slots, ``[num_slots, *entry shape]`` per state entry; slot 0 is all zeros (a
fresh sequence reads it). A step reads each row's state from one slot and
writes the new state to one or more slots (its own, and a snapshot slot when
the row ends on a snapshot point; see engine/hybrid_state.py)::

    read   pools.state[layer][e][read_slots]          -> [B, *shape] (mlx-lm ArraysCache)
    write  pools.state[layer][e][write_slot] = new[b]  (after the whole graph is built)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence as Seq
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_cairn.engine.paged_quant import (
    DEFAULT_KV_GROUP_SIZE,
    check_kv_quant,
    copy_block_rows,
    flat_pools,
    quant_pool,
    write_and_gather_quant,
)
from mlx_cairn.errors import KVPoolSizeError
from mlx_cairn.models.base import LayerSpec

#: Fraction of available memory the default pool may take.
DEFAULT_MEMORY_FRACTION = 0.25
#: The default pool stays under this, unless one full context alone needs more.
DEFAULT_MAX_BYTES = 2 << 30
#: Never leave less than this fraction of available memory when sizing explicitly.
MAX_MEMORY_FRACTION = 0.9
#: A decode mirror (:class:`DecodeMirror`) may take at most this fraction of the pools' bytes.
MIRROR_FRACTION = 0.5
#: ... and is made only for calls whose rows attend to at least this many positions in all:
#: below it, writing every layer's K/V twice costs about what the gather it saves does
#: (bench/RESULTS.md, "A decode mirror").
MIRROR_MIN_POSITIONS = 2048


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
    memory. Raises KVPoolSizeError (a ValueError) when the pool would not fit in
    available memory or is too small.
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
        raise KVPoolSizeError(
            f"KV pool of {want} blocks is too small ({per_block} bytes per block, "
            f"{avail / 2**30:.1f} GiB available)"
        )
    if want * per_block > avail * MAX_MEMORY_FRACTION:
        raise KVPoolSizeError(
            f"KV pool of {want * per_block / 2**30:.2f} GiB does not fit in the "
            f"{avail / 2**30:.2f} GiB of available memory"
        )
    return want


class KVPools:
    """Per-layer K/V block pools and recurrent state slots (MLX arrays), sized once.

    Layer ``i`` with KV owns ``k[i]`` ``[kv_heads, num_blocks, block_size, k_dim]``
    and ``v[i]`` ``[kv_heads, num_blocks, block_size, v_dim]`` from ``layers[i]``.
    Every KV layer has every block, so one block id means the same positions in
    all layers. Heads come first so that a step's gather of its rows' blocks,
    ``k[i][:, tables]``, is already ``[kv_heads, B, T, dim]`` with each (row,
    head) matrix contiguous: attention reads it as ``[B, kv_heads, T, dim]``
    without a second copy (bench/RESULTS.md, "Head-major KV pools"). A recurrent layer owns ``state[i]``: one ``[num_slots, *shape]``
    array per entry of its spec (``k[i]`` / ``v[i]`` are None when it has no KV).
    ``layers`` may be omitted for a uniform model
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
        num_slots: int = 0,
        kv_bits: int | None = None,
        kv_group_size: int = DEFAULT_KV_GROUP_SIZE,
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
        self.num_slots = num_slots if any(s.state for s in self.layers) else 0
        # Quantized pools (engine/paged_quant.py): each k[i] / v[i] is a
        # (packed, scales, biases) triple instead of one array.
        check_kv_quant(kv_bits, kv_group_size, self.layers)
        self.kv_bits = kv_bits
        self.kv_group_size = kv_group_size
        #: The rows of the last decode call, contiguous (see :meth:`mirror_for`).
        self.mirror: DecodeMirror | None = None
        self.mirror_min_positions = MIRROR_MIN_POSITIONS
        # One position of every global layer's K and V: what a mirror holds per row.
        self._mirror_position_bytes = sum(
            s.bytes_per_token(dtype.size) for s in self.layers if s.has_kv and s.window is None
        )
        self.reset()

    def reset(self) -> None:
        """Fresh zeroed pools (pending writes to the old ones are dropped)."""
        n, bs = self.num_blocks, self.block_size
        self.mirror = None

        def kv(s: LayerSpec, d: int) -> Any:
            if not s.has_kv:
                return None
            if self.kv_bits is not None:
                return quant_pool(
                    s.kv_heads, n, bs, d, self.kv_bits, self.kv_group_size, self.dtype
                )
            return mx.zeros((s.kv_heads, n, bs, d), dtype=self.dtype)

        self.k: list[Any] = [kv(s, s.k_dim) for s in self.layers]
        self.v: list[Any] = [kv(s, s.v_dim) for s in self.layers]
        self.state: list[list[mx.array] | None] = [
            [mx.zeros((self.num_slots, *e.shape), dtype=e.dtype) for e in s.state]
            if s.state
            else None
            for s in self.layers
        ]
        mx.eval(self.arrays())  # commit the memory now, not at the first step

    @property
    def has_state(self) -> bool:
        return self.num_slots > 0

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

    @staticmethod
    def slot_bytes(layers: Seq[LayerSpec]) -> int:
        """Bytes of one state slot across ``layers`` (0 for a model without recurrent layers)."""
        return sum(s.state_bytes for s in layers)

    @property
    def nbytes(self) -> int:
        """Bytes of the KV pools."""
        return sum(a.nbytes for a in self.kv_arrays())

    def kv_arrays(self) -> list[mx.array]:
        """Every K/V pool array (a quantized pool's packed words, scales and biases)."""
        return flat_pools(self.k, self.v)

    @property
    def state_nbytes(self) -> int:
        """Bytes of the state slots."""
        return sum(a.nbytes for arrs in self.state if arrs for a in arrs)

    def copy_rows(self, copies: Seq[tuple[int, int, int]]) -> None:
        """For each ``(src, dst, n)``: rows ``0 .. n-1`` of block ``src`` into block ``dst``,
        in every KV layer (:func:`~mlx_cairn.engine.paged_quant.copy_block_rows`)."""
        copy_block_rows(self.kv_arrays(), copies)

    def queue_call(self, outputs: mx.array) -> None:
        """Queue a forward call over the pools (its ``outputs`` and its pool writes)
        before another call over them is built.

        Built into one graph, the second call's in-place pool updates may be
        scheduled before the first call's reads of the same pools; MLX then
        cannot donate those buffers and copies them: every pool, 2 GiB for the
        default model here, turning a 0.4-0.7 s step into 2.0-2.6 s
        (bench/RESULTS.md, issue 17).
        """
        mx.async_eval(outputs, *self.arrays())

    def arrays(self) -> list[mx.array]:
        """Every pool array and the mirror's (to evaluate after a step)."""
        out = self.kv_arrays()
        for arrs in self.state:
            if arrs:
                out.extend(arrs)
        if self.mirror is not None:
            out.extend(self.mirror.arrays())
        return out

    def mirror_for(self, rows: tuple[object, ...], starts: Seq[int]) -> DecodeMirror | None:
        """The mirror a decode call (one new token per row) over ``rows`` at ``starts`` uses.

        The last call's mirror when it held the same rows (by identity, in the
        same order), each now one position further, and has room; else a new
        one, filled by that call's gather, with room for about half as many
        positions again; None when the rows' contexts are short (under
        ``mirror_min_positions`` in all) or it would take more than
        :data:`MIRROR_FRACTION` of the pools' bytes (the call then gathers, as
        every call without a mirror does).
        """
        if self.kv_bits is not None:
            return None  # rows stay packed: a mirror would hold a full-precision copy
        st = np.asarray(starts, dtype=np.int64)
        m = self.mirror
        if (
            m is not None
            and len(m.rows) == len(rows)
            and all(a is b for a, b in zip(m.rows, rows, strict=True))
            and np.array_equal(st, m.starts + 1)
            and int(st.max()) < m.cap
        ):
            m.starts = st
            return m
        self.mirror = None
        bs = self.block_size
        need = int(st.max()) + 1
        per_position = self._mirror_position_bytes
        budget = (
            self.nbytes * MIRROR_FRACTION if len(rows) * need >= self.mirror_min_positions else 0
        )
        for cap in (need + max(64, need // 2), need):
            cap = -(-cap // bs) * bs
            if per_position and len(rows) * cap * per_position <= budget:
                self.mirror = DecodeMirror(rows, st, cap, self.num_layers)
                break
        return self.mirror


class DecodeMirror:
    """The K/V of one decode batch's rows, contiguous per global layer, kept between steps.

    Without it every decode step gathers every row's blocks, in every layer,
    into a fresh ``[kv_heads, B, T, dim]`` array: the whole context is copied
    per generated token (one row of 12 k positions: 550 MB per token for the
    default model, its decode step 1.25x slower than over a mirror on the
    2-core CPU; bench/RESULTS.md, "A decode mirror"). Consecutive decode
    calls over the same rows, each one position further, share one mirror per
    layer, ``[kv_heads, B, cap, dim]``: the first call fills it by gathering,
    the next ones write their new K/V into it as well as into the pools
    (in place, like the pools) and attend over its first T positions. Any other
    call (new rows, a verify or prefill call, a failed one) drops it. Positions
    past a row's context hold anything; the mask hides them, as it hides the
    null block.
    """

    __slots__ = ("cap", "k", "rows", "starts", "v")

    def __init__(self, rows: tuple[object, ...], starts: np.ndarray, cap: int, layers: int) -> None:
        self.rows = rows
        self.starts = starts  # [B] the position each row wrote in the last call
        self.cap = cap
        self.k: list[mx.array | None] = [None] * layers
        self.v: list[mx.array | None] = [None] * layers

    def arrays(self) -> list[mx.array]:
        return [a for a in (*self.k, *self.v) if a is not None]


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
        state_slots: per row, ``(read slot, write slots)`` of its recurrent
            state (models with recurrent layers only).
        mirror: for a decode call (one new token per row), the rows' mirror
            from :meth:`KVPools.mirror_for`: global layers attend over it.

    State writes are held until :meth:`commit` (after the whole graph is
    built), so a forward pass that raises midway writes no state: a recurrent
    state is not idempotent under a retry, unlike a KV row.
    """

    def __init__(
        self,
        pools: KVPools,
        block_tables: Seq[Seq[int]],
        offsets: Seq[int],
        lengths: int | Seq[int],
        state_slots: Seq[tuple[int, Seq[int]]] | None = None,
        mirror: DecodeMirror | None = None,
    ) -> None:
        bs = pools.block_size
        self.pools = pools
        #: The arguments as given (what a distributed runner sends to the other ranks).
        self.inputs = (block_tables, offsets, lengths, state_slots)
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
        self._mirror = mirror
        if mirror is not None:
            if length != 1 or len(mirror.rows) != batch:
                raise ValueError("a mirror serves decode calls only (one token per row)")
            if not mirror.arrays():  # this call fills it: a gather over all its positions
                wide = np.zeros((batch, mirror.cap // bs), dtype=np.int32)
                wide[:, :nblk] = tables
                self._mirror_tables = mx.array(wide)
            self._mirror_rows = mx.arange(batch, dtype=mx.int32)
        self._views: dict[int | None, _View] = {
            None: _View(mx.array(tables), np.arange(nblk * bs)[None, :])
        }
        self._masks: dict[tuple[int | None, int | None], mx.array] = {}
        self._state_writes: list[tuple[int, int, mx.array]] = []
        self._state = None if state_slots is None else _StateRows(state_slots, lens, length)
        if pools.has_state and self._state is None:
            raise ValueError("a model with recurrent layers needs state_slots")
        #: Per-layer caches in the interface mlx-lm's architectures call.
        self.layers = [self._layer_cache(i, s) for i, s in enumerate(pools.layers)]

    def _layer_cache(self, i: int, spec: LayerSpec) -> Any:
        if not spec.state:
            return PagedLayerCache(self, i, spec.window)
        state = _state_cache(self, i, len(spec.state))
        if not spec.has_kv:
            return state
        from mlx_lm.models.cache import CacheList

        return CacheList(state, PagedLayerCache(self, i, spec.window))

    def read_state(self, layer: int, entry: int) -> mx.array:
        """[B, *shape]: each row's state entry (its read slot)."""
        assert self._state is not None
        arrs = self.pools.state[layer]
        assert arrs is not None
        return arrs[entry][self._state.read]

    def write_state(self, layer: int, entry: int, value: mx.array) -> None:
        """Hold a state entry's new value [B, *shape] until :meth:`commit`."""
        self._state_writes.append((layer, entry, value))

    def commit(self) -> None:
        """Write the held state values to their rows' slots (a no-op without state)."""
        if not self._state_writes:
            return
        assert self._state is not None
        src, dst = self._state.write_src, self._state.write_dst
        for layer, entry, value in self._state_writes:
            arrs = self.pools.state[layer]
            assert arrs is not None
            arrs[entry][dst] = _as(value[src], arrs[entry].dtype)
        self._state_writes = []

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
        """Write ``keys``/``values`` [B, kvh, L, d] into layer's pools; gather its view.

        Quantized pools give (packed, scales, biases) triples instead of arrays:
        the attention that takes them (mlx-lm's for a cache with ``bits``,
        ``cpu_attention.attention`` for ours) runs quantized matmuls over them.
        """
        p = self.pools
        if p.kv_bits is not None:
            tables = self.view(geometry).tables
            return write_and_gather_quant(  # type: ignore[return-value]
                p, layer, self._w_block, self._w_row, tables, keys, values
            )
        b, h, n, dk = keys.shape
        dv = values.shape[3]
        # [B, kvh, L, d] -> [kvh, B*L, d], matching the row-major write slots.
        k_rows = _as(keys.transpose(1, 0, 2, 3).reshape(h, b * n, dk), p.dtype)
        v_rows = _as(values.transpose(1, 0, 2, 3).reshape(h, b * n, dv), p.dtype)
        k_pool, v_pool = p.k[layer], p.v[layer]
        assert k_pool is not None and v_pool is not None, f"layer {layer} has no KV pools"
        # In-place scatter: the pool array is donated, nothing is copied.
        k_pool[:, self._w_block, self._w_row] = k_rows
        v_pool[:, self._w_block, self._w_row] = v_rows
        if self._mirror is not None and geometry is None:
            return self._through_mirror(layer, k_rows, v_rows, keys.dtype, values.dtype)
        tables = self.view(geometry).tables
        # [kvh, B, nblk, bs, d] -> [B, kvh, nblk*bs, d]: one copy (the gather), each
        # (row, head) matrix contiguous.
        k_all = k_pool[:, tables].reshape(h, b, -1, dk).transpose(1, 0, 2, 3)
        v_all = v_pool[:, tables].reshape(h, b, -1, dv).transpose(1, 0, 2, 3)
        return _as(k_all, keys.dtype), _as(v_all, values.dtype)

    def _through_mirror(
        self, layer: int, k_rows: mx.array, v_rows: mx.array, k_dtype: mx.Dtype, v_dtype: mx.Dtype
    ) -> tuple[mx.array, mx.array]:
        """A decode call's global layer: the new K/V [kvh, B, d] into the mirror (already in
        the pools), and the mirror's first T positions as [B, kvh, T, d]."""
        m = self._mirror
        assert m is not None
        t = self._np_tables.shape[1] * self.pools.block_size  # the positions attended
        out = []
        for side, rows, pool, dtype in (
            (m.k, k_rows, self.pools.k[layer], k_dtype),
            (m.v, v_rows, self.pools.v[layer], v_dtype),
        ):
            assert pool is not None
            h, b, d = rows.shape
            held = side[layer]
            if held is None:
                held = pool[:, self._mirror_tables].reshape(h, b, m.cap, d)
            else:
                held[:, self._mirror_rows, self._offsets] = rows
            side[layer] = held
            out.append(_as(held[:, :, :t].transpose(1, 0, 2, 3), dtype))
        return out[0], out[1]

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
        if owner.pools.kv_bits is not None:
            # mlx-lm's attention runs its quantized path for caches with these.
            self.bits = owner.pools.kv_bits
            self.group_size = owner.pools.kv_group_size

    @property
    def offset(self) -> mx.array:
        return self._owner.offsets

    @property
    def keys(self) -> mx.array:
        """The layer's K pool. mlx-lm's pipelines tie their send to the last layer's
        cache (``cache[-1].keys = mx.depends(cache[-1].keys, h)``); the distributed
        runner evaluates the call's output, which the send is part of, so the
        assignment is dropped."""
        k = self._owner.pools.k[self.layer]
        return k[0] if isinstance(k, tuple) else k

    @keys.setter
    def keys(self, value: mx.array) -> None:
        pass

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
        return flat_pools([p.k[self.layer]], [p.v[self.layer]])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)


class _StateRows:
    """Slot indices of one step's rows: where each reads its state, where it writes."""

    __slots__ = ("read", "write_dst", "write_src")

    def __init__(self, slots: Seq[tuple[int, Seq[int]]], lens: np.ndarray, length: int) -> None:
        # Rows with recurrent state are never padded (runner._prefill_groups): not
        # every mlx-lm recurrent layer keeps its state over padding.
        if not bool((lens == length).all()):
            raise ValueError("rows with recurrent state must all feed the same number of tokens")
        self.read = mx.array([r for r, _ in slots], dtype=mx.int32)
        src = [b for b, (_, ws) in enumerate(slots) for _ in ws]
        self.write_src = mx.array(src, dtype=mx.int32)
        self.write_dst = mx.array([w for _, ws in slots for w in ws], dtype=mx.int32)


def _state_cache(owner: PagedKVCache, layer: int, size: int) -> Any:
    """Layer ``layer``'s recurrent state as mlx-lm's ``ArraysCache`` (read from the
    rows' slots; what the layer stores is held for :meth:`PagedKVCache.commit`)."""
    from mlx_lm.models.cache import ArraysCache

    cache = _paged_state_class(ArraysCache)(size)
    cache.owner, cache.layer = owner, layer
    cache.cache = [owner.read_state(layer, e) for e in range(size)]
    return cache


_STATE_CLASS: list[type] = []


def _paged_state_class(base: type) -> type:
    """One ``ArraysCache`` subclass whose stores go to the owner (made once, on first use)."""
    if _STATE_CLASS:
        return _STATE_CLASS[0]

    class PagedStateCache(base):  # type: ignore[misc, valid-type]
        owner: PagedKVCache
        layer: int

        def __setitem__(self, idx: int, value: mx.array) -> None:
            self.cache[idx] = value
            self.owner.write_state(self.layer, idx, value)

    _STATE_CLASS.append(PagedStateCache)
    return PagedStateCache


def _as(x: mx.array, dtype: mx.Dtype) -> mx.array:
    return x if x.dtype == dtype else x.astype(dtype)

"""Quantized KV block pools: K and V packed along the head dimension (issue 39).

The same head-major layout as :class:`~mlx_cairn.engine.paged.KVPools`, with
each full-precision pool replaced by the triple mlx-lm's ``QuantizedKVCache``
keeps (``mx.quantize`` output: packed ``uint32`` words, per-group scales and
biases), so a block id means the same positions in every layer and in all
three arrays::

    packed  [kv_heads, num_blocks, block_size, dim * bits // 32]   uint32
    scales  [kv_heads, num_blocks, block_size, dim // group_size]  pool dtype
    biases  [kv_heads, num_blocks, block_size, dim // group_size]  pool dtype

A write quantizes only the new rows; attention gathers a row's packed blocks
and runs mlx-lm's ``quantized_scaled_dot_product_attention`` (two
``mx.quantized_matmul`` calls) over them, so the context is never
dequantized into a full-precision copy.

:class:`~mlx_cairn.engine.paged.KVPools` holds such triples in place of its
arrays when built with ``kv_bits``; :class:`QuantBlocks` is the same storage
on its own, what the tests check against mlx-lm's quantized cache.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import quantized_scaled_dot_product_attention

from mlx_cairn.models.base import LayerSpec
from mlx_cairn.types import DEFAULT_KV_GROUP_SIZE, KV_BITS, KV_GROUP_SIZES

QTriple = tuple[mx.array, mx.array, mx.array]


class KVQuantError(ValueError):
    """KV quantization settings (``kv_bits``, ``kv_group_size``) a model cannot take."""


def check_kv_quant(bits: int | None, group_size: int, layers: Seq[LayerSpec]) -> None:
    """Refuse settings the pools cannot hold, with a message naming the fix.

    Raises:
        KVQuantError: ``bits`` not None/8/4, a group size ``mx.quantize`` does not
            take, or one that does not divide a layer's K or V head dimension.
    """
    if bits is None:
        return
    if bits not in KV_BITS:
        raise KVQuantError(f"kv_bits must be 8 or 4 (or unset for full precision), got {bits}")
    if group_size not in KV_GROUP_SIZES:
        raise KVQuantError(
            f"kv_group_size must be one of {', '.join(map(str, KV_GROUP_SIZES))}, got {group_size}"
        )
    for i, s in enumerate(layers):
        if not s.has_kv:
            continue  # recurrent state stays full precision
        for name, d in (("key", s.k_dim), ("value", s.v_dim)):
            if d % group_size:
                raise KVQuantError(
                    f"kv_group_size {group_size} does not divide layer {i}'s {name} head "
                    f"dimension {d}; pick a group size that divides it"
                )


def packed_dim(dim: int, bits: int) -> int:
    """uint32 words one quantized row of width ``dim`` takes."""
    return dim * bits // 32


def bytes_per_token(spec: LayerSpec, bits: int, group_size: int, itemsize: int) -> int:
    """K + V bytes one position of ``spec`` takes when quantized (packed + scales + biases)."""

    def row(d: int) -> int:
        return 4 * packed_dim(d, bits) + 2 * (d // group_size) * itemsize

    return spec.kv_heads * (row(spec.k_dim) + row(spec.v_dim)) if spec.has_kv else 0


def block_bytes(
    layers: Seq[LayerSpec], block_size: int, bits: int, group_size: int, itemsize: int
) -> int:
    """Quantized K + V bytes one block takes across ``layers`` (what a budget counts)."""
    return block_size * sum(bytes_per_token(s, bits, group_size, itemsize) for s in layers)


def quant_pool(
    kv_heads: int,
    num_blocks: int,
    block_size: int,
    dim: int,
    bits: int,
    group_size: int,
    dtype: mx.Dtype,
) -> QTriple:
    """A zeroed quantized pool: (packed, scales, biases), head-major like a full one."""
    shape = (kv_heads, num_blocks, block_size)
    g = dim // group_size
    return (
        mx.zeros((*shape, packed_dim(dim, bits)), dtype=mx.uint32),
        mx.zeros((*shape, g), dtype=dtype),
        mx.zeros((*shape, g), dtype=dtype),
    )


def copy_block_rows(pools: Seq[mx.array], copies: Seq[tuple[int, int, int]]) -> None:
    """For each ``(src, dst, n)``: rows ``0 .. n-1`` of block ``src`` into block ``dst``
    of every pool (axis 1 is the block).

    The source blocks are read into arrays of their own and evaluated first
    (this waits for a step in flight): an update whose value still aliases
    its pool cannot be done in place, and MLX would copy the whole pool.
    """
    src = mx.array([c[0] for c in copies], dtype=mx.int32)
    got = [mx.take(p, src, axis=1) for p in pools]
    mx.eval(got)
    for pool, rows in zip(pools, got, strict=True):
        for j, (_, dst, n) in enumerate(copies):
            pool[:, dst, :n] = rows[:, j, :n]


def flat_pools(k: Seq[Any], v: Seq[Any]) -> list[mx.array]:
    """Every array of the pools ``k`` and ``v`` (arrays, triples or None)."""
    out: list[mx.array] = []
    for p in (*k, *v):
        if isinstance(p, tuple):
            out.extend(p)
        elif p is not None:
            out.append(p)
    return out


def _quantize(rows: mx.array, bits: int, group_size: int, dtype: mx.Dtype) -> QTriple:
    q = mx.quantize(rows, group_size=group_size, bits=bits)
    return q[0], q[1].astype(dtype), q[2].astype(dtype)


def write_and_gather_quant(
    pools: Any,
    layer: int,
    w_block: mx.array,
    w_row: mx.array,
    tables: mx.array,
    keys: mx.array,
    values: mx.array,
) -> tuple[QTriple, QTriple]:
    """Quantize a step's new ``keys``/``values`` [B, kvh, L, d] into their slots
    (``w_block``/``w_row``, row-major over [B, L]) of layer's quantized pools and
    gather the packed blocks of ``tables`` [B, nblk]: each of K and V comes back as
    ``[B, kvh, nblk*bs, ...]`` triples for mlx-lm's quantized attention."""
    bits, group, dtype = pools.kv_bits, pools.kv_group_size, pools.dtype
    k, v = pools.k[layer], pools.v[layer]
    assert k is not None and v is not None, f"layer {layer} has no KV pools"
    b = keys.shape[0]
    out = []
    for pool, new in ((k, keys), (v, values)):
        h, d = new.shape[1], new.shape[3]
        rows = new.transpose(1, 0, 2, 3).reshape(h, -1, d)
        for arr, q in zip(pool, _quantize(rows, bits, group, dtype), strict=True):
            arr[:, w_block, w_row] = q  # in place: the pool is donated
        out.append(
            tuple(a[:, tables].reshape(h, b, -1, a.shape[-1]).transpose(1, 0, 2, 3) for a in pool)
        )
    return out[0], out[1]  # type: ignore[return-value]


class QuantBlocks:
    """Quantized K and V pools of every KV layer (``None`` for layers without KV)."""

    def __init__(
        self,
        *,
        layers: Seq[LayerSpec],
        num_blocks: int,
        block_size: int,
        bits: int,
        group_size: int = DEFAULT_KV_GROUP_SIZE,
        dtype: mx.Dtype = mx.float32,
    ) -> None:
        check_kv_quant(bits, group_size, layers)
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (block 0 is reserved), got {num_blocks}"
            )
        self.layers = tuple(layers)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.bits, self.group_size, self.dtype = bits, group_size, dtype

        def pool(s: LayerSpec, d: int) -> QTriple | None:
            if not s.has_kv:
                return None
            return quant_pool(s.kv_heads, num_blocks, block_size, d, bits, group_size, dtype)

        self.k = [pool(s, s.k_dim) for s in self.layers]
        self.v = [pool(s, s.v_dim) for s in self.layers]
        mx.eval(self.arrays())

    def arrays(self) -> list[mx.array]:
        return flat_pools(self.k, self.v)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def _quantize(self, rows: mx.array) -> QTriple:
        return _quantize(rows, self.bits, self.group_size, self.dtype)

    def write(
        self, layer: int, blocks: mx.array, rows: mx.array, keys: mx.array, values: mx.array
    ) -> None:
        """Quantize ``keys``/``values`` ``[kv_heads, N, d]`` into (``blocks[n]``, ``rows[n]``)."""
        k, v = self.k[layer], self.v[layer]
        assert k is not None and v is not None, f"layer {layer} has no KV pools"
        for pool, new in ((k, keys), (v, values)):
            for arr, q in zip(pool, self._quantize(new), strict=True):
                arr[:, blocks, rows] = q

    def gather(self, layer: int, tables: mx.array) -> tuple[QTriple, QTriple]:
        """Packed K and V of ``tables`` ``[B, nblk]``, each ``[B, kv_heads, nblk*bs, ...]``."""
        k, v = self.k[layer], self.v[layer]
        assert k is not None and v is not None, f"layer {layer} has no KV pools"
        b = tables.shape[0]

        def take(a: mx.array) -> mx.array:
            h, w = a.shape[0], a.shape[-1]
            return a[:, tables].reshape(h, b, -1, w).transpose(1, 0, 2, 3)

        return (
            (take(k[0]), take(k[1]), take(k[2])),
            (take(v[0]), take(v[1]), take(v[2])),
        )

    def attend(
        self,
        queries: mx.array,
        layer: int,
        tables: mx.array,
        scale: float,
        mask: mx.array | None,
    ) -> mx.array:
        """Attention of ``queries`` ``[B, heads, L, d]`` over the packed blocks of ``tables``."""
        qk, qv = self.gather(layer, tables)
        # mlx-lm scales with ``queries *= scale``, which rebinds the caller's
        # array in place: scale here into a new array and pass 1.0.
        return quantized_scaled_dot_product_attention(
            queries * scale,
            qk,
            qv,
            scale=1.0,
            mask=mask,
            group_size=self.group_size,
            bits=self.bits,
        )

    def copy_rows(self, copies: Seq[tuple[int, int, int]]) -> None:
        """For each ``(src, dst, n)``: packed rows ``0 .. n-1`` of block ``src`` and their
        scales and biases into block ``dst``, in every KV layer (as ``KVPools.copy_rows``)."""
        copy_block_rows(self.arrays(), copies)

"""Read and check a GGUF file's header: metadata values and the tensor table.

One pass over the header, the metadata records and the tensor records checks
that every length fits in the file, every type is known to the ``gguf``
package, and every tensor's data lies inside the data section, so a broken
file is a :class:`ModelLoadError` for that model only (never a crash, never a
read past the end). It reads records, not weights.

Why not ``gguf.GGUFReader``: it builds two numpy views per array element, so
its constructor takes ~2.6 s on SmolLM2's 49k-token vocabulary and ~15 s on
Gemma 3's 262k (measured here); this walk decodes the same records in well
under a second. ``tests/test_gguf_read.py`` checks it against GGUFReader.
Block sizes and type codes come from ``gguf.constants``.

Layout (GGUF v2/v3, little endian)::

    "GGUF" u32 version  u64 n_tensors  u64 n_kv
    n_kv    x  (string key, u32 type, value)
    n_tensors x (string name, u32 n_dims, u64 dims[n_dims], u32 ggml_type, u64 offset)
    padding to general.alignment (default 32), then the data section
    string = u64 length + bytes;  array = u32 type + u64 count + values
    dims are innermost first: a [out, in] matrix is stored as dims (in, out)
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from mlx_cairn.errors import ModelLoadError

#: Metadata scalar types: GGUF type code -> numpy dtype (8 = string, 9 = array).
_SCALAR: dict[int, np.dtype[Any]] = {
    0: np.dtype("<u1"),
    1: np.dtype("<i1"),
    2: np.dtype("<u2"),
    3: np.dtype("<i2"),
    4: np.dtype("<u4"),
    5: np.dtype("<i4"),
    6: np.dtype("<f4"),
    7: np.dtype("bool"),
    10: np.dtype("<u8"),
    11: np.dtype("<i8"),
    12: np.dtype("<f8"),
}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4
_MAX_ARRAY_NESTING = 8


@dataclass(frozen=True)
class TensorInfo:
    """One tensor record; ``shape`` is in numpy order (outermost first)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    #: Absolute byte offset of the data in the file, and its length.
    offset: int
    nbytes: int


@dataclass
class GGUFHeader:
    """Everything in a GGUF file but the tensor data.

    ``metadata`` values are Python scalars and strings, lists for arrays of
    strings (or of arrays), and numpy arrays for arrays of numbers.
    """

    version: int
    metadata: dict[str, Any] = field(default_factory=dict)
    tensors: list[TensorInfo] = field(default_factory=list)
    alignment: int = 32
    data_offset: int = 0


class _Reader:
    def __init__(self, buf: mmap.mmap | bytes, name: str) -> None:
        self.buf = buf
        self.pos = 0
        self.name = name

    def fail(self, what: str) -> ModelLoadError:
        return ModelLoadError(
            f"{self.name} is not a valid GGUF file ({what} at byte {self.pos}); "
            "it may be corrupt or an incomplete download"
        )

    def take(self, n: int) -> int:
        if n < 0 or self.pos + n > len(self.buf):
            raise self.fail("a record extends past the end of the file")
        start = self.pos
        self.pos += n
        return start

    def u32(self) -> int:
        return int(struct.unpack_from("<I", self.buf, self.take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack_from("<Q", self.buf, self.take(8))[0])

    def string(self) -> str:
        n = self.u64()
        start = self.take(n)
        return bytes(self.buf[start : start + n]).decode("utf-8", errors="replace")

    def value(self, kind: int, depth: int = 0) -> Any:
        if kind in _SCALAR:
            dt = _SCALAR[kind]
            return np.frombuffer(self.buf, dt, 1, self.take(dt.itemsize))[0].item()
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            if depth >= _MAX_ARRAY_NESTING:
                raise self.fail("arrays nested too deeply")
            elem, count = self.u32(), self.u64()
            if elem in _SCALAR:
                dt = _SCALAR[elem]
                return np.frombuffer(self.buf, dt, count, self.take(count * dt.itemsize)).copy()
            if elem == _STRING:
                if count * 8 > len(self.buf) - self.pos:  # each string takes at least 8 bytes
                    raise self.fail("an array count larger than the file")
                return self._strings(count)
            if elem == _ARRAY:
                if count * 12 > len(self.buf) - self.pos:
                    raise self.fail("an array count larger than the file")
                return [self.value(elem, depth + 1) for _ in range(count)]
            raise self.fail(f"unknown array element type {elem}")
        raise self.fail(f"unknown metadata type {kind}")

    def _strings(self, count: int) -> list[str]:
        # The hot loop of a 262k-token vocabulary: locals and no method calls per item.
        buf, pos, size = self.buf, self.pos, len(self.buf)
        unpack = struct.Struct("<Q").unpack_from
        out = []
        for _ in range(count):
            if pos + 8 > size:
                self.pos = pos
                raise self.fail("a record extends past the end of the file")
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > size:
                self.pos = pos
                raise self.fail("a record extends past the end of the file")
            out.append(bytes(buf[pos : pos + n]).decode("utf-8", errors="replace"))
            pos += n
        self.pos = pos
        return out


def read_header(path: Path) -> GGUFHeader:
    """Metadata and tensor table of ``path``; any structural problem is a :class:`ModelLoadError`."""
    name = path.name
    try:
        with path.open("rb") as f:
            if path.stat().st_size < 24:
                raise ModelLoadError(f"{name} is too short to be a GGUF file")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _walk(_Reader(buf, name))
    except OSError as e:
        raise ModelLoadError(f"cannot read {name}: {e}") from None


def check_gguf(path: Path) -> None:
    """Raise :class:`ModelLoadError` unless ``path`` is a structurally sound GGUF file."""
    read_header(path)


def _walk(r: _Reader) -> GGUFHeader:
    if bytes(r.buf[0:4]) != b"GGUF":
        raise r.fail("bad magic")
    r.take(4)
    version = r.u32()
    if version & 0xFFFF == 0 and version:
        raise r.fail("a big-endian GGUF file (only little-endian files load)")
    if version not in (2, 3):
        raise r.fail(f"unsupported GGUF version {version}")
    n_tensors, n_kv = r.u64(), r.u64()
    size = len(r.buf)
    # Smallest records: a tensor takes 8+4+8+4+8 bytes, a metadata entry 8+4+1.
    if n_tensors * 32 + n_kv * 13 > size:
        raise r.fail(f"header counts ({n_tensors} tensors, {n_kv} entries) larger than the file")
    header = GGUFHeader(version=version)
    for _ in range(n_kv):
        key = r.string()
        header.metadata[key] = r.value(r.u32())
    alignment = header.metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise r.fail("general.alignment is not a power of two")
    header.alignment = alignment
    records: list[tuple[str, tuple[int, ...], GGMLQuantizationType, int, int]] = []
    for _ in range(n_tensors):
        tname = r.string()
        n_dims = r.u32()
        if not 1 <= n_dims <= _MAX_DIMS:
            raise r.fail(f"a tensor with {n_dims} dimensions")
        dims = [r.u64() for _ in range(n_dims)]
        kind = r.u32()
        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError:
            raise r.fail(f"unsupported tensor type {kind}") from None
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        if dims[0] % block:
            raise r.fail("a tensor row that is not a whole number of blocks")
        count = 1
        for d in dims:
            count *= d
        records.append((tname, tuple(reversed(dims)), qtype, r.u64(), count // block * block_bytes))
    data = -(-r.pos // alignment) * alignment
    header.data_offset = data
    for tname, shape, qtype, offset, nbytes in records:
        if offset % alignment or data + offset + nbytes > size:
            raise r.fail("tensor data outside the data section")
        header.tensors.append(TensorInfo(tname, shape, qtype, data + offset, nbytes))
    return header

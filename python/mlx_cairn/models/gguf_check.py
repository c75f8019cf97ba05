"""Structural check of a GGUF file before ``mx.load`` reads it.

MLX's GGUF reader trusts the lengths and counts in the file: a corrupt header
or metadata record makes it crash the whole process (a segfault, not an
exception), which in a server takes every other model down with it. This walk
over the header, the metadata records and the tensor records checks that
every length fits in the file, every type is known, and every tensor's data
lies inside the data section, so a broken file is a :class:`ModelLoadError`
for that model only. It reads records, not weights (~0.1 s for SmolLM2).

Layout (GGUF v2/v3, little endian)::

    "GGUF" u32 version  u64 n_tensors  u64 n_kv
    n_kv    x  (string key, u32 type, value)
    n_tensors x (string name, u32 n_dims, u64 dims[n_dims], u32 ggml_type, u64 offset)
    padding to general.alignment (default 32), then the data section
    string = u64 length + bytes;  array = u32 type + u64 count + values
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from mlx_cairn.errors import ModelLoadError

#: Fixed sizes of the scalar metadata types (8 = string, 9 = array).
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
#: ggml tensor types: (elements per block, bytes per block).
_GGML = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
    9: (32, 36), 10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176),
    14: (256, 210), 15: (256, 292), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8),
    28: (1, 8), 30: (1, 2),
}  # fmt: skip
_MAX_DIMS = 4
_MAX_ARRAY_NESTING = 8


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

    def string(self) -> bytes:
        n = self.u64()
        start = self.take(n)
        return bytes(self.buf[start : start + n])

    def skip_string(self) -> None:
        self.take(self.u64())

    def value(self, kind: int, depth: int = 0) -> int | None:
        """Skip one metadata value; return it when it is an unsigned integer."""
        if kind in _SCALAR:
            size = _SCALAR[kind]
            start = self.take(size)
            if kind in (4, 10):
                return int.from_bytes(self.buf[start : start + size], "little")
            return None
        if kind == _STRING:
            self.skip_string()
            return None
        if kind == _ARRAY:
            if depth >= _MAX_ARRAY_NESTING:
                raise self.fail("arrays nested too deeply")
            elem, count = self.u32(), self.u64()
            if elem in _SCALAR:
                self.take(count * _SCALAR[elem])
            elif elem in (_STRING, _ARRAY):
                if count > len(self.buf) - self.pos:  # each element takes at least 8 bytes
                    raise self.fail("an array count larger than the file")
                for _ in range(count):
                    self.value(elem, depth + 1)
            else:
                raise self.fail(f"unknown array element type {elem}")
            return None
        raise self.fail(f"unknown metadata type {kind}")


def check_gguf(path: Path) -> None:
    """Raise :class:`ModelLoadError` unless ``path`` is a structurally sound GGUF file."""
    name = path.name
    try:
        with path.open("rb") as f:
            if path.stat().st_size < 24:
                raise ModelLoadError(f"{name} is too short to be a GGUF file")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                _walk(_Reader(buf, name))
    except OSError as e:
        raise ModelLoadError(f"cannot read {name}: {e}") from None


def _walk(r: _Reader) -> None:
    if bytes(r.buf[0:4]) != b"GGUF":
        raise r.fail("bad magic")
    r.take(4)
    version = r.u32()
    if version not in (2, 3):
        raise r.fail(f"unsupported GGUF version {version}")
    n_tensors, n_kv = r.u64(), r.u64()
    size = len(r.buf)
    # Smallest records: a tensor takes 8+4+8+4+8 bytes, a metadata entry 8+4+1.
    if n_tensors * 32 + n_kv * 13 > size:
        raise r.fail(f"header counts ({n_tensors} tensors, {n_kv} entries) larger than the file")
    alignment = 32
    for _ in range(n_kv):
        key = r.string()
        kind = r.u32()
        val = r.value(kind)
        if key == b"general.alignment":
            if not val or val & (val - 1):
                raise r.fail("general.alignment is not a power of two")
            alignment = val
    tensors: list[tuple[int, int]] = []
    for _ in range(n_tensors):
        r.skip_string()
        n_dims = r.u32()
        if not 1 <= n_dims <= _MAX_DIMS:
            raise r.fail(f"a tensor with {n_dims} dimensions")
        count = 1
        dims = [r.u64() for _ in range(n_dims)]
        for d in dims:
            count *= d
        kind = r.u32()
        if kind not in _GGML:
            raise r.fail(f"unsupported tensor type {kind}")
        block, block_bytes = _GGML[kind]
        if dims[0] % block:
            raise r.fail("a tensor row that is not a whole number of blocks")
        tensors.append((r.u64(), count // block * block_bytes))
    data = -(-r.pos // alignment) * alignment
    for offset, nbytes in tensors:
        if offset % alignment or data + offset + nbytes > size:
            raise r.fail("tensor data outside the data section")

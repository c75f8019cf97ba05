"""The disk tier under the block pool: evicted KV blocks kept in files (issue 19).

A full block that leaves the pool while its hash is still cached is copied
out (a lazy gather queued before the step that reuses it), and a writer
thread appends it to the tier in batches. A lookup that runs out of resident
blocks goes on here: the request waits in its own admission state while a
reader thread loads the blocks, then they are written into fresh pool blocks
and registered, and the request is admitted as a prefix hit::

    pool (resident)  | b0 b1 b2 |                      lookup stops at b3
    disk tier        |          | b3 b4 b5 | ...       read b3..b5 in the background,
    pool, then       | b0 b1 b2   b3 b4 b5 |           register, admit: 6 blocks hit

Files (one per batch of blocks, ``<dir>/<model key>/<n>.kvb``)::

    MAGIC | u32 header length | header (JSON) | payload: block 0 | block 1 | ...
    header: format version, model key (identity, block size, dtype, layer
            shapes), block bytes, per block its chain hash and CRC-32

A block's payload is, per KV layer, its K rows then its V rows
(``[block_size, kv_heads, dim]`` in the pool dtype). Writes go to a temp file
that is renamed into place, so a crash leaves only whole files (and stray
temp files, removed at start-up). A file whose header does not parse or
belongs to another model, format or shape is removed when found; a block
whose CRC does not match is a miss. So no damaged or foreign file can give a
wrong answer. Hashes survive a restart because the engine seeds the chain
from the model identity when the tier is on (the salt already holds it).

The budget is kept over the whole directory (every model's files): the
least recently used files go first.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_cairn.models.base import LayerSpec

log = logging.getLogger("mlx_cairn.engine")

MAGIC = b"CAIRNKV\x00"
FORMAT = 1
SUFFIX = ".kvb"
#: A hybrid model's state snapshot: one per file.
STATE_SUFFIX = ".kvs"
#: Blocks per file (a batch of evictions is split into files of at most this many).
FILE_BLOCKS = 64


def stable_seed(identity: str) -> int:
    """A chain-hash seed that is the same in every process for one model."""
    return int.from_bytes(hashlib.sha256(identity.encode()).digest()[:8], "little")


def _np_dtype(dtype: mx.Dtype) -> np.dtype[Any]:
    if dtype == mx.float32:
        return np.dtype(np.float32)
    if dtype == mx.float16:
        return np.dtype(np.float16)
    return np.dtype(np.uint16)  # bfloat16 travels as its raw 16 bits


@dataclass
class DiskStats:
    blocks: int = 0
    bytes: int = 0
    hit_blocks: int = 0
    written_blocks: int = 0
    read_bytes: int = 0
    read_seconds: float = 0.0
    write_bytes: int = 0
    write_seconds: float = 0.0
    dropped_files: int = 0
    corrupt_blocks: int = 0


@dataclass
class _Staged:
    hashes: list[int]
    arrays: list[mx.array]  # per KV layer: K [n, bs, h, d], V [n, bs, h, d]


@dataclass
class Loaded:
    """Blocks read back for one request: per KV layer its K then its V rows,
    ``[len(hashes), block_size, kv_heads, dim]`` each."""

    hashes: list[int]
    arrays: list[np.ndarray] = field(default_factory=list)
    #: A hybrid's state snapshot read with them (per state entry).
    state: list[np.ndarray] | None = None


@dataclass
class _StateWrite:
    hash: int
    num_blocks: int
    payload: bytes


class DiskTier:
    """The disk tier of one engine (see the module docstring).

    Args:
        root: ``--kv-disk-dir``; this model's files go in a subdirectory.
        budget_bytes: the most the directory may hold.
        identity: the model identity (weights fingerprint, dtype).
        block_size, dtype, layers: the pool's shape.
    """

    def __init__(
        self,
        root: Path,
        *,
        budget_bytes: int,
        identity: str,
        block_size: int,
        dtype: mx.Dtype,
        layers: Seq[LayerSpec],
    ) -> None:
        self.root = Path(root)
        self.budget = int(budget_bytes)
        self.block_size = block_size
        self.dtype = dtype
        self._np = _np_dtype(dtype)
        self.kv_layers = [i for i, s in enumerate(layers) if s.has_kv]
        self._shapes = [
            (
                (block_size, layers[i].kv_heads, layers[i].k_dim),
                (block_size, layers[i].kv_heads, layers[i].v_dim),
            )
            for i in self.kv_layers
        ]
        per = self._np.itemsize
        self.block_bytes = sum((int(np.prod(k)) + int(np.prod(v))) * per for k, v in self._shapes)
        #: Where each K / V part lies in a block, in elements.
        self._slices: list[tuple[int, int, tuple[int, ...]]] = []
        at = 0
        for k, v in self._shapes:
            for shape in (k, v):
                n = int(np.prod(shape))
                self._slices.append((at, at + n, shape))
                at += n
        #: Recurrent state entries (hybrids): (layer, entry, shape, dtype) in slot order.
        self.state_entries = [
            (i, e, entry.shape, entry.dtype)
            for i, spec in enumerate(layers)
            for e, entry in enumerate(spec.state)
        ]
        self.state_bytes = sum(en.nbytes for spec in layers for en in spec.state)
        key = {
            "identity": identity,
            "block_size": block_size,
            "dtype": str(dtype),
            "layers": [[list(k), list(v)] for k, v in self._shapes],
            "state": [[i, e, list(sh), str(dt)] for i, e, sh, dt in self.state_entries],
        }
        self.key = key
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        self.dir = self.root / digest
        self.dir.mkdir(parents=True, exist_ok=True)
        self.stats = DiskStats()
        self._lock = threading.Lock()
        #: hash -> (file name, index in it, CRC-32)
        self._index: dict[int, tuple[str, int, int]] = {}
        #: file name -> (hashes, bytes), least recently used first
        self._files: OrderedDict[str, tuple[list[int], int]] = OrderedDict()
        #: state snapshots (hybrids): hash -> (file name, number of blocks, CRC-32)
        self._snaps: dict[int, tuple[str, int, int]] = {}
        self._names = itertools.count(int(time.time() * 1000) % 10**12)
        self._scan()
        self._staged: list[_Staged] = []
        self._staged_states: list[tuple[int, int, list[mx.array]]] = []
        self._writes: queue.Queue[
            tuple[list[int], bytes] | _StateWrite | threading.Event | None
        ] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="cairn-kv-disk", daemon=True)
        self._writer.start()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="cairn-kv-read")

    # ------------------------------------------------------------ start-up

    def _scan(self) -> None:
        """Index this model's complete files; remove temp files and foreign or broken ones."""
        entries = []
        for p in self.dir.iterdir():
            if p.suffix == STATE_SUFFIX:
                snap = self._snap_header(p)
                if snap is None:
                    self.stats.dropped_files += 1
                    with contextlib.suppress(OSError):
                        p.unlink()
                else:
                    self._snaps[int(snap["hash"])] = (p.name, int(snap["blocks"]), int(snap["crc"]))
                continue
            if p.suffix != SUFFIX:
                with contextlib.suppress(OSError):
                    p.unlink()  # an interrupted write
                continue
            header = self._header(p)
            if header is None:
                self.stats.dropped_files += 1
                with contextlib.suppress(OSError):
                    p.unlink()
                continue
            entries.append((p.stat().st_mtime, p.name, header))
        for _, name, header in sorted(entries):
            hashes = [int(h) for h in header["hashes"]]
            size = len(hashes) * self.block_bytes
            self._files[name] = (hashes, size)
            for i, (h, crc) in enumerate(zip(hashes, header["crc"], strict=True)):
                self._index[h] = (name, i, int(crc))
            self.stats.bytes += size
        self.stats.blocks = len(self._index)

    def _header(self, path: Path) -> dict[str, Any] | None:
        """The header of a block file of this model and format, or None."""
        return self._checked(path, lambda h: len(h["hashes"]) * self.block_bytes, blocks=True)

    def _snap_header(self, path: Path) -> dict[str, Any] | None:
        """The header of a state snapshot file of this model and format, or None."""
        return self._checked(path, lambda h: self.state_bytes, blocks=False)

    def _checked(
        self, path: Path, payload: Callable[[dict[str, Any]], int], *, blocks: bool
    ) -> dict[str, Any] | None:
        """A file's header if its magic, format, model key and length (``payload(header)``
        bytes after it: else it was cut short) are right; its payload offset added."""
        try:
            with open(path, "rb") as f:
                if f.read(len(MAGIC)) != MAGIC:
                    return None
                (n,) = struct.unpack("<I", f.read(4))
                header = json.loads(f.read(n))
            if header.get("format") != FORMAT or header.get("key") != self.key:
                return None
            if blocks and (
                len(header["crc"]) != len(header["hashes"])
                or header["block_bytes"] != self.block_bytes
            ):
                return None
            if path.stat().st_size != len(MAGIC) + 4 + n + payload(header):
                return None
            header["offset"] = len(MAGIC) + 4 + n
            return header  # type: ignore[no-any-return]
        except (OSError, ValueError, KeyError, TypeError, struct.error):
            return None

    # ------------------------------------------------------------ engine thread

    def capture(self, victims: list[tuple[int, int]], pools: Any) -> None:
        """Blocks ``(block id, hash)`` about to be reused: copy them out (lazily, before the
        step that overwrites them) unless the tier has them already."""
        with self._lock:
            victims = [(b, h) for b, h in victims if h not in self._index]
        if not victims:
            return
        ids = mx.array([b for b, _ in victims], dtype=mx.int32)
        arrays: list[mx.array] = []
        for layer in self.kv_layers:
            arrays.append(pools.k[layer][ids])
            arrays.append(pools.v[layer][ids])
        mx.async_eval(arrays)
        self._staged.append(_Staged([h for _, h in victims], arrays))

    def has_snapshot(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._snaps

    def capture_state(self, block_hash: int, num_blocks: int, slot: int, pools: Any) -> None:
        """A state snapshot leaving memory (its slot about to be reused): copy it out."""
        if self.has_snapshot(block_hash) or not self.state_entries:
            return
        arrays = [pools.state[i][e][slot] for i, e, _, _ in self.state_entries]
        mx.async_eval(arrays)
        self._staged_states.append((block_hash, num_blocks, arrays))

    def best_snapshot(self, hashes: Any, start: int, end: int) -> int:
        """The largest ``k`` in ``(start, end]`` whose prefix ``hashes[:k]`` has a
        snapshot on disk (0: none)."""
        with self._lock:
            for k in range(end, start, -1):
                if int(hashes[k - 1]) in self._snaps:
                    return k
        return 0

    def flush(self) -> None:
        """Hand the copied blocks to the writer thread (after the step that computed them)."""
        states, self._staged_states = self._staged_states, []
        for h, nb, arrays in states:
            payload = b"".join(
                np.ascontiguousarray(
                    np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)
                ).tobytes()
                for a in arrays
            )
            self._writes.put(_StateWrite(h, nb, payload))
        staged, self._staged = self._staged, []
        for st in staged:
            host = [
                np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a) for a in st.arrays
            ]
            for start in range(0, len(st.hashes), FILE_BLOCKS):
                end = min(start + FILE_BLOCKS, len(st.hashes))
                payload = b"".join(
                    np.ascontiguousarray(h[i]).tobytes() for i in range(start, end) for h in host
                )
                self._writes.put((st.hashes[start:end], payload))

    def run_length(self, hashes: Any, start: int, limit: int) -> int:
        """How many of ``hashes[start:limit]`` the tier holds, in a row."""
        n = 0
        with self._lock:
            for i in range(start, limit):
                if int(hashes[i]) not in self._index:
                    break
                n += 1
        return n

    def read(self, hashes: list[int], snapshot: int | None = None) -> Future[Loaded]:
        """Load ``hashes``' blocks on the reader thread (a block that fails its check
        ends the run there), and the state snapshot stored under hash ``snapshot``."""

        def both() -> Loaded:
            out = self._read(hashes)
            if snapshot is not None:
                t0 = time.perf_counter()
                out.state = self._read_state(snapshot)
                self.stats.read_seconds += time.perf_counter() - t0
            return out

        return self._reader.submit(both)

    # ------------------------------------------------------------ threads

    def _read(self, hashes: list[int]) -> Loaded:
        """Read ``hashes``' blocks: runs of consecutive blocks of one file in one read."""
        t0 = time.perf_counter()
        out = Loaded([])
        with self._lock:
            where = []
            for h in hashes:
                w = self._index.get(h)
                if w is None or w[0] not in self._files:
                    break
                where.append(w)
        runs: list[list[tuple[str, int, int]]] = []
        for w in where:
            if runs and runs[-1][-1][0] == w[0] and runs[-1][-1][1] + 1 == w[1]:
                runs[-1].append(w)
            else:
                runs.append([w])
        bb = self.block_bytes
        buf = np.empty(len(where) * bb, dtype=np.uint8)  # every run lands in one buffer
        view = memoryview(buf)  # type: ignore[arg-type]
        done = 0  # blocks read and checked
        for run in runs:
            name = run[0][0]
            path = self.dir / name
            header = self._header(path)
            if header is None:
                self._forget(name, remove=True)
                break
            dest = view[done * bb : (done + len(run)) * bb]
            try:
                with open(path, "rb", buffering=0) as f:
                    f.seek(header["offset"] + run[0][1] * bb)
                    got = f.readinto(dest) or 0
                os.utime(path)  # recently used (the budget's LRU)
            except OSError:
                self._forget(name)
                break
            ok = 0
            for j, (_, _, crc) in enumerate(run):
                if (j + 1) * bb > got or zlib.crc32(dest[j * bb : (j + 1) * bb]) != crc:
                    self.stats.corrupt_blocks += 1
                    self._forget(name, remove=True)
                    break
                ok += 1
            done += ok
            with self._lock:
                if name in self._files:
                    self._files.move_to_end(name)
            if ok < len(run):
                break
        out.hashes = hashes[:done]
        if done:
            out.arrays = self._unpack(buf[: done * bb], done)
        nbytes = done * bb
        self.stats.read_bytes += nbytes
        self.stats.read_seconds += time.perf_counter() - t0
        self.stats.hit_blocks += len(out.hashes)
        return out

    def _unpack(self, raw: np.ndarray, n: int) -> list[np.ndarray]:
        """``n`` blocks' bytes -> per KV layer K and V views ``[n, *shape]``."""
        flat = raw.view(self._np).reshape(n, -1)
        # Contiguous copies: mx.array() of a strided view is ~100x slower than of these.
        return [
            np.ascontiguousarray(flat[:, a:b]).reshape(n, *shape) for a, b, shape in self._slices
        ]

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            if item is None:
                return
            if isinstance(item, threading.Event):  # drain(): everything before it is written
                item.set()
                continue
            try:
                if isinstance(item, _StateWrite):
                    self._write_state(item)
                else:
                    self._write(*item)
            except OSError as e:  # a full or read-only disk: the blocks are just not kept
                log.warning("kv disk tier: write failed: %s", e)

    def _write(self, hashes: list[int], payload: bytes) -> None:
        t0 = time.perf_counter()
        bb = self.block_bytes
        crcs = [zlib.crc32(payload[i * bb : (i + 1) * bb]) for i in range(len(hashes))]
        header = json.dumps(
            {
                "format": FORMAT,
                "key": self.key,
                "block_bytes": bb,
                "hashes": [str(h) for h in hashes],
                "crc": crcs,
            }
        ).encode()
        name = f"{next(self._names)}{SUFFIX}"
        tmp = self.dir / (name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<I", len(header)) + header)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.dir / name)
        with self._lock:
            self._files[name] = (hashes, len(payload))
            for i, (h, crc) in enumerate(zip(hashes, crcs, strict=True)):
                self._index[h] = (name, i, crc)
            self.stats.bytes += len(payload)
            self.stats.blocks = len(self._index)
            self.stats.written_blocks += len(hashes)
        self.stats.write_bytes += len(payload)
        self.stats.write_seconds += time.perf_counter() - t0
        self._keep_budget()

    def _write_state(self, item: _StateWrite) -> None:
        t0 = time.perf_counter()
        crc = zlib.crc32(item.payload)
        header = json.dumps(
            {
                "format": FORMAT,
                "key": self.key,
                "hash": str(item.hash),
                "blocks": item.num_blocks,
                "crc": crc,
            }
        ).encode()
        name = f"{next(self._names)}{STATE_SUFFIX}"
        tmp = self.dir / (name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<I", len(header)) + header)
            f.write(item.payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.dir / name)
        with self._lock:
            self._snaps[item.hash] = (name, item.num_blocks, crc)
        self.stats.write_bytes += len(item.payload)
        self.stats.write_seconds += time.perf_counter() - t0
        self._keep_budget()

    def _read_state(self, block_hash: int) -> list[np.ndarray] | None:
        with self._lock:
            where = self._snaps.get(block_hash)
        if where is None:
            return None
        name, _, crc = where
        path = self.dir / name
        header = self._snap_header(path)
        raw = None
        if header is not None:
            try:
                with open(path, "rb") as f:
                    f.seek(header["offset"])
                    raw = f.read(self.state_bytes)
                os.utime(path)
            except OSError:
                raw = None
        if raw is None or len(raw) != self.state_bytes or zlib.crc32(raw) != crc:
            self.stats.corrupt_blocks += 1
            with self._lock:
                self._snaps.pop(block_hash, None)
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        self.stats.read_bytes += len(raw)
        out = []
        at = 0
        for _, _, shape, dtype in self.state_entries:
            npd = _np_dtype(dtype)
            n = int(np.prod(shape)) * npd.itemsize
            out.append(np.frombuffer(raw[at : at + n], dtype=npd).reshape(shape))
            at += n
        return out

    def _forget(self, name: str, *, remove: bool = False) -> None:
        with self._lock:
            hashes, size = self._files.pop(name, ([], 0))
            for h in hashes:
                if self._index.get(h, ("",))[0] == name:
                    del self._index[h]
            self.stats.bytes -= size
            self.stats.blocks = len(self._index)
        if remove:
            self.stats.dropped_files += 1
            with contextlib.suppress(OSError):
                (self.dir / name).unlink()

    def _keep_budget(self) -> None:
        """Remove least recently used files (by mtime: reads touch their file) until the
        whole directory fits the budget."""
        files = []
        total = 0
        for p in [*self.root.glob(f"*/*{SUFFIX}"), *self.root.glob(f"*/*{STATE_SUFFIX}")]:
            with contextlib.suppress(OSError):
                st = p.stat()
                files.append((st.st_mtime, p, st.st_size))
                total += st.st_size
        for _, p, size in sorted(files, key=lambda x: x[0]):
            if total <= self.budget:
                break
            if p.parent == self.dir:
                if p.suffix == STATE_SUFFIX:
                    with self._lock:
                        for h, w in list(self._snaps.items()):
                            if w[0] == p.name:
                                del self._snaps[h]
                else:
                    self._forget(p.name)
            with contextlib.suppress(OSError):
                p.unlink()
            total -= size

    def close(self) -> None:
        self._writes.put(None)
        self._writer.join(timeout=30)
        self._reader.shutdown(wait=True)

    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write is on disk (tests, shutdown)."""
        done = threading.Event()
        self._writes.put(done)
        return done.wait(timeout)

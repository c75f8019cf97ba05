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

    MAGIC | u32 header length | header (JSON) | payload (below)
    header: format version, model key (identity, block size, dtype, layer
            shapes; quantized pools: bits, group size), block bytes, per block its chain hash and CRC-32C;
            padded with spaces so that the payload starts at a 4 KiB boundary

The payload is layer-major: per KV layer, the K rows of all the file's
blocks, then their V rows (``[n, block_size, kv_heads, dim]`` in the pool
dtype), so that a read lands each layer's K and V of every block it loads in
one contiguous array, with no per-block split::

    payload  | K0: b0 b1 .. | V0: b0 b1 .. | K1: b0 b1 .. | V1: ..
    a block's CRC-32C runs over its rows of every part, in this order

Quantized pools (``kv_bits``, engine/paged_quant.py) are stored as they are:
each of K and V is three parts, the packed words (``uint32``) then the scales
and the biases (pool dtype), ``[n, block_size, kv_heads, width]`` each::

    payload  | K0 packed | K0 scales | K0 biases | V0 packed | .. | K1 packed | ..

The KV format (bits, group size, dtype) is part of the model key, so a tier
written at other settings lives in another subdirectory and is never read;
a file of theirs moved into ours fails the header check and is removed.

A read of blocks from several files takes them in parallel, each file's
blocks in one positioned read (``preadv``: a whole file's payload is one
range, scattered over the parts) straight into one buffer that every layer's
arrays view, with no copy after it. Where the platform and the shapes allow,
reads are direct (``O_DIRECT``: no page cache, no copy through it, the whole
range in flight at once); CRC-32C (google-crc32c, in hardware) checks them.

Writes go to a temp file that is renamed into place, so a crash leaves only
whole files (and stray temp files, removed at start-up). A file whose header does not parse or
belongs to another model, format or shape is removed when found; a block
whose CRC does not match is a miss. So no damaged or foreign file can give a
wrong answer. Hashes survive a restart because the engine seeds the chain
from the model identity when the tier is on (the salt already holds it).

The budget is kept over the whole directory (every model's files): the
least recently used files go first.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import json
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import google_crc32c
import mlx.core as mx
import numpy as np

from mlx_cairn.models.base import LayerSpec
from mlx_cairn.types import DEFAULT_KV_GROUP_SIZE

log = logging.getLogger("mlx_cairn.engine")

MAGIC = b"CAIRNKV\x00"
FORMAT = 2  # 2: layer-major, aligned, CRC-32C (1: block-major, CRC-32)
SUFFIX = ".kvb"
#: A hybrid model's state snapshot: one per file.
STATE_SUFFIX = ".kvs"
#: Blocks per file (a batch of evictions is split into files of at most this many).
FILE_BLOCKS = 64
#: Files one read takes at once.
READERS = 4
#: Where a block file's payload starts (a multiple of this): direct reads need it.
ALIGN = 4096
#: Direct reads (no page cache) where the platform has them; the parts' sizes and the
#: disk's sector must suit them too, else reads go through the page cache.
O_DIRECT: int = getattr(os, "O_DIRECT", 0)


def stable_seed(identity: str) -> int:
    """A chain-hash seed that is the same in every process for one model."""
    return int.from_bytes(hashlib.sha256(identity.encode()).digest()[:8], "little")


def _aligned(nbytes: int) -> np.ndarray:
    """``nbytes`` of fresh memory starting at an ``ALIGN`` boundary (direct reads)."""
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    at = -raw.ctypes.data % ALIGN
    return raw[at : at + nbytes]


#: Buffers in one vectored read (the POSIX minimum of IOV_MAX is 16; Linux and macOS
#: take 1024).
IOV_MAX = 512


def _read_at(fd: int, dests: list[memoryview], offset: int) -> int:
    """``preadv``; where it is missing, seek and ``readv`` (each read has its own fd)."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, dests, offset)
    os.lseek(fd, offset, os.SEEK_SET)
    return os.readv(fd, dests)


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
    ``[len(hashes), block_size, kv_heads, dim]`` each (quantized pools: K's packed
    words, scales and biases, then V's; in the order of
    :meth:`DiskTier.pool_arrays`), contiguous views of one buffer: ``mx.array`` of
    each is a plain copy."""

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
        kv_bits, kv_group_size: the pool's quantization (None: full precision).
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
        kv_bits: int | None = None,
        kv_group_size: int = DEFAULT_KV_GROUP_SIZE,
    ) -> None:
        self.root = Path(root)
        self.budget = int(budget_bytes)
        self.block_size = block_size
        self.dtype = dtype
        self.kv_bits = kv_bits
        self._np = _np_dtype(dtype)
        self.kv_layers = [i for i, s in enumerate(layers) if s.has_kv]
        self._shapes = [
            (
                (block_size, layers[i].kv_heads, layers[i].k_dim),
                (block_size, layers[i].kv_heads, layers[i].v_dim),
            )
            for i in self.kv_layers
        ]
        #: The payload's parts (K0, V0, K1, ..; quantized: K0 packed, scales, biases,
        #: V0 ..): one block's shape, bytes and host dtype in each, and the bytes of
        #: one block in the parts before it (a part of ``n`` blocks starts at
        #: ``n * before`` in a file's payload and in a read's buffer).
        self._parts: list[tuple[tuple[int, ...], int, int, np.dtype[Any]]] = []
        at = 0
        for k, v in self._shapes:
            for bs, h, d in (k, v):
                if kv_bits is None:
                    pieces = [((bs, h, d), self._np)]
                else:
                    g = (bs, h, d // kv_group_size)
                    pieces = [((bs, h, d * kv_bits // 32), np.dtype(np.uint32))]
                    pieces += [(g, self._np), (g, self._np)]
                for shape, npd in pieces:
                    n = int(np.prod(shape)) * npd.itemsize
                    self._parts.append((shape, n, at, npd))
                    at += n
        self.block_bytes = at
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
        if kv_bits is not None:
            # The KV format: a tier written at other settings is another key (full
            # precision keeps the key it always had, so its tiers stay valid).
            key["kv_bits"] = kv_bits
            key["kv_group_size"] = kv_group_size
        self.key = key
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        self.dir = self.root / digest
        self.dir.mkdir(parents=True, exist_ok=True)
        self.stats = DiskStats()
        self._lock = threading.Lock()
        #: hash -> (file name, index in it, CRC-32C)
        self._index: dict[int, tuple[str, int, int]] = {}
        #: file name -> (hashes, bytes), least recently used first
        self._files: OrderedDict[str, tuple[list[int], int]] = OrderedDict()
        #: state snapshots (hybrids): hash -> (file name, number of blocks, CRC-32C)
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
        #: The reader's file reads, in parallel (they wait on the disk, not the GIL).
        self._io = ThreadPoolExecutor(READERS, thread_name_prefix="cairn-kv-io")
        self._direct = bool(O_DIRECT) and all(pb % 512 == 0 for _, pb, _, _ in self._parts)
        if google_crc32c.implementation != "c":  # no wheel for this platform: pure Python
            log.warning("kv disk tier: google-crc32c has no C build here; reads will be slow")

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
        # The pools are head-major; the files keep [blocks, block_size, kv_heads, width].
        arrays = [mx.contiguous(a[:, ids].transpose(1, 2, 0, 3)) for a in self.pool_arrays(pools)]
        mx.async_eval(arrays)
        self._staged.append(_Staged([h for _, h in victims], arrays))

    def pool_arrays(self, pools: Any) -> list[mx.array]:
        """The pool arrays (head-major ``[kv_heads, num_blocks, block_size, width]``) in
        the order of the payload's parts: per KV layer its K then its V, each one array
        or a quantized pool's (packed, scales, biases)."""
        out: list[mx.array] = []
        for layer in self.kv_layers:
            for pool in (pools.k[layer], pools.v[layer]):
                out.extend(pool if isinstance(pool, tuple) else (pool,))
        assert len(out) == len(self._parts), "the pools are not the tier's KV format"
        return out

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
                payload = b"".join(np.ascontiguousarray(h[start:end]).tobytes() for h in host)
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
        """Read ``hashes``' blocks: each run of consecutive blocks of one file in one job,
        the jobs in parallel, all into one buffer laid out like a file's payload::

            buf  | K0: run 0 run 1 .. | V0: run 0 run 1 .. | K1: ..
            (part p of the whole read starts at len(where) * before_p)
        """
        t0 = time.perf_counter()
        out = Loaded([])
        #: Per block: its file, index in it, CRC, and the file's number of blocks.
        where: list[tuple[str, int, int, int]] = []
        with self._lock:
            for h in hashes:
                found = self._index.get(h)
                if found is None or found[0] not in self._files:
                    break
                where.append((*found, len(self._files[found[0]][0])))
        runs: list[list[tuple[str, int, int, int]]] = []
        for w in where:
            if runs and runs[-1][-1][0] == w[0] and runs[-1][-1][1] + 1 == w[1]:
                runs[-1].append(w)
            else:
                runs.append([w])
        total = len(where)
        buf = _aligned(total * self.block_bytes)
        view = memoryview(buf)  # type: ignore[arg-type]
        jobs = []
        at = 0
        for run in runs:
            jobs.append(self._io.submit(self._read_run, run, view, total, at))
            at += len(run)
        done = 0  # blocks read and checked
        for run, job in zip(runs, jobs, strict=True):
            name = run[0][0]
            ok, err = job.result()
            done += ok
            if err == "missing":
                self._forget(name, remove=True)
            elif err == "io":
                self._forget(name)
            elif err == "corrupt":
                self.stats.corrupt_blocks += 1
                self._forget(name, remove=True)
            else:
                with self._lock:
                    if name in self._files:
                        self._files.move_to_end(name)
            if ok < len(run):
                for later in jobs:
                    later.cancel()
                break
        out.hashes = hashes[:done]
        if done:
            out.arrays = [
                buf[total * before : total * before + done * pb].view(npd).reshape(done, *shape)
                for shape, pb, before, npd in self._parts
            ]
        self.stats.read_bytes += done * self.block_bytes
        self.stats.read_seconds += time.perf_counter() - t0
        self.stats.hit_blocks += len(out.hashes)
        return out

    def _read_run(
        self, run: list[tuple[str, int, int, int]], view: memoryview, total: int, at: int
    ) -> tuple[int, str | None]:
        """Read one run (blocks ``first..`` of a file of ``n``) into the read's buffer at
        block ``at`` of ``total``, and check it: (blocks good in a row, what went wrong)."""
        name, first, _, n = run[0]
        m = len(run)
        path = self.dir / name
        header = self._header(path)
        if header is None or len(header["hashes"]) != n:
            return 0, "missing"
        base = header["offset"]
        dests = [
            view[total * before + at * pb : total * before + (at + m) * pb]
            for _, pb, before, _ in self._parts
        ]
        try:
            got = self._pread(path, dests, base, n, first, m)
            os.utime(path)  # recently used (the budget's LRU)
        except OSError:
            return 0, "io"
        if got != m * self.block_bytes:
            return 0, "corrupt"
        ro = np.frombuffer(view, dtype=np.uint8)
        ro.flags.writeable = False
        for j, (_, _, crc, _) in enumerate(run):
            if self._crc(ro, total, at + j) != crc:
                return j, "corrupt"
        return m, None

    def _pread(
        self, path: Path, dests: list[memoryview], base: int, n: int, first: int, m: int
    ) -> int:
        """Read blocks ``first..first+m`` of each part of a file of ``n`` into ``dests``
        (one per part): bytes read. Direct when it can be (a whole file: one request)."""
        direct = self._direct
        fd = os.open(path, os.O_RDONLY | (O_DIRECT if direct else 0))
        try:
            try:
                return self._preadv(fd, dests, base, n, first, m)
            except OSError as e:
                if not direct or e.errno != errno.EINVAL:
                    raise
                self._direct = False  # this file system or disk takes no direct reads
        finally:
            os.close(fd)
        return self._pread(path, dests, base, n, first, m)

    def _preadv(
        self, fd: int, dests: list[memoryview], base: int, n: int, first: int, m: int
    ) -> int:
        if m == n:  # the whole payload: one range of the file, scattered over the parts
            got = 0
            for i in range(0, len(dests), IOV_MAX):
                got += _read_at(fd, dests[i : i + IOV_MAX], base + got)
            return got
        return sum(
            _read_at(fd, [d], base + n * before + first * pb)
            for (_, pb, before, _), d in zip(self._parts, dests, strict=True)
        )

    def _crc(self, view: np.ndarray, n: int, i: int) -> int:
        """CRC-32C of block ``i`` in a layer-major region of ``n`` blocks (a file's
        payload, a read's buffer): over its rows of every part, in order."""
        c = 0
        for _, pb, before, _ in self._parts:
            at = n * before + i * pb
            c = google_crc32c.extend(c, view[at : at + pb])
        return c

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
        view = np.frombuffer(payload, dtype=np.uint8)
        crcs = [self._crc(view, len(hashes), i) for i in range(len(hashes))]
        header = json.dumps(
            {
                "format": FORMAT,
                "key": self.key,
                "block_bytes": self.block_bytes,
                "hashes": [str(h) for h in hashes],
                "crc": crcs,
            }
        ).encode()
        header += b" " * (-(len(MAGIC) + 4 + len(header)) % ALIGN)  # the payload starts aligned
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
        crc = google_crc32c.value(item.payload)
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
        if raw is None or len(raw) != self.state_bytes or google_crc32c.value(raw) != crc:
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
        self._io.shutdown(wait=True)

    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write is on disk (tests, shutdown)."""
        done = threading.Event()
        self._writes.put(done)
        return done.wait(timeout)

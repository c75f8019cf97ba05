"""Corrupt model files fail to load with an error; they never crash the process.

A server loads every ``--model`` into one process, so a file that crashes the
loader (MLX's GGUF reader segfaults on corrupt records) would take the good
models down too. Each corrupted variant of a valid GGUF is loaded in a child
process, which must survive all of them: every variant either loads or raises.
"""

from __future__ import annotations

import json
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_cairn.testing.tiny_models import tiny_model
from models_fixtures import write_tiny_gguf

pytestmark = pytest.mark.timeout(300)

CHILD = r"""
import json, sys
import mlx_cairn
from mlx_cairn.errors import ModelLoadError
from mlx_cairn.models import load
out = {}
for path in sys.argv[1:]:
    print(path, flush=True, file=sys.stderr)   # the last one printed is the culprit of a crash
    try:
        load(path)
        out[path] = "loaded"
    except ModelLoadError as e:
        out[path] = "ModelLoadError"
    except Exception as e:
        out[path] = type(e).__name__ + ": " + str(e)[:200]
print(json.dumps(out))
"""


def variants(good: bytes, rng: random.Random) -> dict[str, bytes]:
    """Named corruptions of a valid GGUF file."""
    out: dict[str, bytes] = {
        "empty": b"",
        "magic-only": b"GGUF",
        "garbage-after-magic": b"GGUF" + rng.randbytes(4096),
        "huge-tensor-count": good[:8] + struct.pack("<Q", 10**9) + good[16:],
        "huge-kv-count": good[:16] + struct.pack("<Q", 2**63) + good[24:],
        "bad-version": good[:4] + struct.pack("<I", 99) + good[8:],
        "truncated-header": good[:100],
        "truncated-metadata": good[: len(good) // 50],
        "truncated-data": good[: len(good) // 2],
    }
    # The first key's length, then the first value's type field, made absurd.
    key_len = struct.unpack_from("<Q", good, 24)[0]
    out["huge-key-length"] = good[:24] + struct.pack("<Q", 2**62) + good[32:]
    t = 32 + key_len
    out["unknown-value-type"] = good[:t] + struct.pack("<I", 77) + good[t + 4 :]
    # Random byte flips in the record area (header, metadata, tensor records).
    records = min(len(good), 4096)
    for i in range(24):
        b = bytearray(good)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(8, records)] = rng.randrange(256)
        out[f"flips-{i}"] = bytes(b)
    return out


def test_corrupt_gguf_files_raise_and_never_crash(tmp_path: Path) -> None:
    good_path = write_tiny_gguf(tiny_model("llama"), tmp_path / "good.gguf")
    good = good_path.read_bytes()
    paths = [str(good_path)]
    for name, data in variants(good, random.Random(7)).items():
        p = tmp_path / f"{name}.gguf"
        p.write_bytes(data)
        paths.append(str(p))
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, *paths], capture_output=True, text=True, timeout=240
    )
    last = proc.stderr.strip().splitlines()[-1:] if proc.stderr else []
    assert proc.returncode == 0, f"the loader crashed (rc {proc.returncode}) on {last}"
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert results[str(good_path)] == "loaded"
    for path, outcome in results.items():
        if path != str(good_path) and "flips" not in path:
            assert outcome == "ModelLoadError", (path, outcome)

"""The disk tier: TTFT after a restart vs cold, and read-back throughput vs the disk alone.

Issue 19's bars on the embedded SmolLM2-135M (fp32 KV on CPU, block size 16):

- restart: a request with a ~2,500-token system prompt, the engine closed
  (its cached blocks go to the disk tier) and a new engine opened on the same
  directory (what a restart of ``cairn serve`` does; tests/test_serve_disk.py
  runs real processes), then the same system prompt with another question.
  TTFT of that request vs the same request on an engine without a tier;
  the bar is <= 0.1x, with ``cached_tokens`` >= 95% of the system part.
- throughput: the tier's own read-back (bytes / seconds of its reads, page
  cache dropped for its files first) next to the disk alone (``dd`` with
  O_DIRECT over a file of the same size, written just before, as the tier's
  files are). Once in each restart above, and ``--read-reps`` more times on a
  tier of the same shapes alone (no model running: the read and ``dd``
  alternate, so both see the same load).

Run::

    .venv/bin/python bench/bench_disk.py --reps 3 --read-reps 10

Prints Markdown tables for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import mlx_cairn  # noqa: F401  (loads the optimized BLAS before mlx.core)
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.engine.disk import DiskTier
from mlx_cairn.models import load
from mlx_cairn.types import ChatRequest, Done, Message, SamplingParams

SYSTEM = (
    "You are a coding agent working in a large repository. Follow the project's "
    "conventions, keep changes small, run the tests before you finish, and explain "
    "what you changed and why in a short note. "
) * 60


def ask(engine: Engine, question: str) -> Done:
    req = ChatRequest(
        messages=[Message("system", SYSTEM), Message("user", question)],
        max_tokens=1,
        sampling=SamplingParams(temperature=0.0),
    )
    done = list(engine.generate_sync(req, timeout=600))[-1]
    assert isinstance(done, Done), done
    return done


def drop_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_alone(dirpath: Path, nbytes: int) -> float:
    """GB/s of a sequential O_DIRECT read of a file of ``nbytes`` (dd)."""
    f = dirpath / "probe.bin"
    mb = max(64, nbytes >> 20)
    subprocess.run(
        ["dd", "if=/dev/urandom", f"of={f}", "bs=1M", f"count={mb}", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    drop_cache([f])
    t0 = time.perf_counter()
    subprocess.run(
        ["dd", f"if={f}", "of=/dev/null", "bs=4M", "iflag=direct"],
        check=True,
        capture_output=True,
    )
    dt = time.perf_counter() - t0
    f.unlink()
    return mb * (1 << 20) / dt / 1e9


def read_back(lm: object, reps: int, num_blocks: int) -> list[tuple[float, float]]:
    """(tier GB/s, disk alone GB/s) per rep: ``num_blocks`` blocks of the model's shapes
    written to a fresh tier (new files each rep), the page cache dropped, read back."""
    out = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("CAIRN_BENCH_DISK_DIR")) as tmp:
        d = Path(tmp)
        e = Engine(
            lm, EngineConfig(num_blocks=num_blocks + 8)
        )  # its pools: the shapes and some rows
        p = e._pools
        e.close()
        tier = DiskTier(
            d / "tier",
            budget_bytes=1 << 40,
            identity="bench",
            block_size=p.block_size,
            dtype=p.dtype,
            layers=p.layers,
        )
        try:
            for rep in range(reps):
                hashes = [(rep + 1) << 32 | b for b in range(num_blocks)]
                tier.capture(list(zip(range(1, num_blocks + 1), hashes, strict=True)), p)
                tier.flush()
                assert tier.drain()
                drop_cache(sorted(tier.dir.glob("*.kvb")))
                b0, s0 = tier.stats.read_bytes, tier.stats.read_seconds
                got = tier.read(hashes).result()
                assert got.hashes == hashes
                nbytes = tier.stats.read_bytes - b0
                gbs = nbytes / (tier.stats.read_seconds - s0) / 1e9
                for f in tier.dir.glob("*.kvb"):  # the next rep reads new files
                    tier._forget(f.name, remove=True)
                alone = disk_alone(d, nbytes)
                out.append((gbs, alone))
                print(
                    f"read rep {rep}: tier {gbs:.2f} GB/s, disk alone {alone:.2f} GB/s"
                    f" ({nbytes / 2**20:.0f} MiB, load {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
        finally:
            tier.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--read-reps", type=int, default=10)
    ap.add_argument("--read-blocks", type=int, default=150)
    args = ap.parse_args()
    lm = load(None)
    reads = read_back(lm, args.read_reps, args.read_blocks) if args.read_reps else []
    rows = []
    for rep in range(args.reps):
        with tempfile.TemporaryDirectory(dir=os.environ.get("CAIRN_BENCH_DISK_DIR")) as tmp:
            d = Path(tmp)
            e = Engine(lm, EngineConfig(kv_disk_dir=d))
            ask(e, f"Question {rep}: what does the build do?")
            n_system = ask(e, "x").usage.cached_tokens  # the system part, resident
            e.close()
            files = sorted(d.glob("*/*.kvb"))
            drop_cache(files)
            e = Engine(lm, EngineConfig(kv_disk_dir=d))  # the restart
            hit = ask(e, f"Question {rep}: which tests are slow?")
            st = e.stats()
            e.close()
            plain = Engine(lm)
            cold = ask(plain, f"Question {rep}: which tests are slow?")
            plain.close()
            tier = st.disk_read_bytes / st.disk_read_seconds / 1e9 if st.disk_read_seconds else 0
            alone = disk_alone(d, st.disk_read_bytes)
        row = (
            cold.timings.ttft_ms,
            hit.timings.ttft_ms,
            hit.usage.cached_tokens,
            n_system,
            hit.usage.input_tokens,
            tier,
            alone,
            st.disk_read_bytes,
        )
        rows.append(row)
        print(
            f"rep {rep}: cold {row[0]:.0f} ms, after restart {row[1]:.0f} ms, cached {row[2]} of"
            f" {row[4]} (system part {row[3]}); tier read {tier:.2f} GB/s, disk alone"
            f" {alone:.2f} GB/s ({row[7] / 2**20:.0f} MiB)",
            flush=True,
        )
    med = [statistics.median(r[i] for r in rows) for i in range(8)]
    print(f"\nload average after: {os.getloadavg()}\n")
    print("| prompt tokens | cold TTFT ms | after restart TTFT ms | ratio | cached tokens |")
    print("|---|---|---|---|---|")
    print(
        f"| {med[4]:.0f} (system {med[3]:.0f}) | {med[0]:.0f} | {med[1]:.0f} |"
        f" {med[1] / med[0]:.3f} | {med[2]:.0f} |"
    )
    print("\n| read-back (median) | in the restarts | tier alone, alternating with dd |")
    print("|---|---|---|")
    t = statistics.median(r[0] for r in reads) if reads else float("nan")
    a = statistics.median(r[1] for r in reads) if reads else float("nan")
    print(f"| disk tier (its reads, page cache dropped) | {med[5]:.2f} | {t:.2f} |")
    print(f"| the disk alone (dd, O_DIRECT, {med[7] / 2**20:.0f} MiB) | {med[6]:.2f} | {a:.2f} |")
    print(f"\nreads: {len(reads)} reps, tier >= 1 GB/s in {sum(r[0] >= 1 for r in reads)}")


if __name__ == "__main__":
    main()

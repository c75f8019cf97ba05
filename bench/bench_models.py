"""Single-stream decode and prefill of the default model: mlx-cairn vs mlx_lm, side by side.

Both sides run in this one process on the same fp32 weights (the embedded
SmolLM2-135M GGUF, dequantized; exported to a temporary HF folder for
mlx_lm) with the same optimized BLAS (``import mlx_cairn`` loads it before
MLX). Rounds alternate between the two sides so machine noise hits both.

Reports:
- decode tokens/s (greedy, EOS ignored; time from first to last token);
- prefill tokens/s for a PROMPT-token prompt (time to first token);
- decode as a fraction of the memory-bandwidth roofline:
  bytes read per token / measured copy bandwidth;
- a profile of one decode step (graph building vs. parts of the forward).

Usage::

    .venv/bin/python bench/bench_models.py [--rounds 3] [--decode 32] [--prompt 2000] [--prefill-rounds 1] [--prefill-sdpa]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator

import mlx_cairn  # noqa: F401  (optimized BLAS before mlx.core)

import mlx.core as mx  # isort: skip
import mlx.nn as nn  # isort: skip
import numpy as np  # isort: skip
from mlx.utils import tree_flatten  # isort: skip

from mlx_cairn.engine.reference import generate_tokens, prefill  # isort: skip
from mlx_cairn.models import ContiguousKVCache, load  # isort: skip
from mlx_cairn.backends.cpu import layout as cpu_layout  # isort: skip
from mlx_cairn.models import llama  # isort: skip
from mlx_cairn.backends.cpu.layout import BlockedLinear, hf_parameters  # isort: skip
from mlx_cairn.models.export import save_folder  # isort: skip
from mlx_cairn.types import SamplingParams  # isort: skip

GREEDY = SamplingParams(temperature=0.0)


def copy_bandwidth(nbytes: int = 256 << 20, reps: int = 7) -> float:
    """Best STREAM-style copy bandwidth in bytes/s (read + write counted)."""
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.ones_like(src)  # both touched: no page faults in the timed loop
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = max(best, 2 * nbytes / (time.perf_counter() - t))
    return best


def bytes_per_token(lm, context: int) -> int:
    """Weights read per decode step (tied head counted once) plus the KV cache at ``context``."""
    params = hf_parameters(lm.model)
    total = sum(v.nbytes for v in params.values())
    if not lm.model.args.tie_word_embeddings:
        total -= params["model.embed_tokens.weight"].nbytes  # only one row is gathered
    m = lm.model
    kv = 2 * m.num_layers * m.num_kv_heads * m.head_dim * 4 * context
    return total + kv


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _timed_stream(tokens: Iterator[object]) -> tuple[float, float]:
    """(tokens/s, CPU ms per token) between the first and the last token of a stream."""
    times, cpu0 = [], 0.0
    for _ in tokens:
        times.append(time.perf_counter())
        if len(times) == 1:
            cpu0 = _cpu_s()
    n = len(times) - 1
    return n / (times[-1] - times[0]), (_cpu_s() - cpu0) / n * 1e3


def _time_to_first(tokens: Iterator[object], n_prompt: int) -> float:
    t = time.perf_counter()
    next(iter(tokens))
    return n_prompt / (time.perf_counter() - t)


class Ours:
    """mlx-cairn's reference loop (the same forward the engine runs)."""

    def __init__(self, lm) -> None:
        self.lm = lm

    def stream(self, prompt: list[int], n: int) -> Iterator[int]:
        return generate_tokens(self.lm.model, prompt, max_tokens=n, sampling=GREEDY)


class OursMlxSdpa(Ours):
    """The reference loop with MLX's ``scaled_dot_product_attention`` for prefill too (the old path)."""

    def stream(self, prompt: list[int], n: int) -> Iterator[int]:
        fast = llama.attention
        llama.attention = lambda q, k, v, scale, mask: mx.fast.scaled_dot_product_attention(
            q, k, v, scale=scale, mask=mask
        )
        try:
            yield from super().stream(prompt, n)
        finally:
            llama.attention = fast


class Theirs:
    """mlx_lm's ``stream_generate`` on the same weights (EOS disabled)."""

    def __init__(self, folder: str) -> None:
        import mlx_lm

        self.model, self.tokenizer = mlx_lm.load(folder)
        self.tokenizer._eos_token_ids = set()

    def stream(self, prompt: list[int], n: int) -> Iterator[object]:
        from mlx_lm import stream_generate
        from mlx_lm.sample_utils import make_sampler

        gen = stream_generate(
            self.model, self.tokenizer, prompt, max_tokens=n, sampler=make_sampler(0.0)
        )
        return (r.token for r in gen)


def _best_of(fn: Callable[[], None], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def profile_step(lm, context: int = 128, reps: int = 5) -> list[tuple[str, float, int]]:
    """Time parts of one decode step over all layers: (part, seconds, bytes of weights read)."""
    m = lm.model
    layers = m.model.layers
    cache = ContiguousKVCache(m.num_layers)
    mx.eval(prefill(m, cache, list(range(100, 100 + context))))
    x = mx.random.normal((1, 1, m.args.hidden_size))
    tok = mx.array([[5]], dtype=mx.int32)
    mx.eval(x)

    def nbytes(mods: list[nn.Module]) -> int:
        return sum(v.nbytes for mod in mods for _, v in tree_flatten(mod.parameters()))

    def full() -> None:
        mx.eval(m.logits(m(tok, cache)[:, -1, :]))
        cache.trim(1)

    def build() -> None:
        m.logits(m(tok, cache)[:, -1, :])
        cache.trim(1)

    def attn_proj() -> None:
        outs = []
        for layer in layers:
            a = layer.self_attn
            outs += [a.q_proj(x), a.k_proj(x), a.v_proj(x)]
            outs.append(a.o_proj(mx.zeros((1, 1, a.n_heads * a.head_dim))))
        mx.eval(outs)

    def attn_core() -> None:
        outs = []
        for layer in layers:
            a = layer.self_attn
            q = mx.zeros((1, a.n_heads, 1, a.head_dim))
            k = mx.zeros((1, a.n_kv_heads, 1, a.head_dim))
            q, k = a.rope(q, cache.offsets), a.rope(k, cache.offsets)
            ka, va, mask = cache.update_and_fetch(a.layer, k, k)
            outs.append(mx.fast.scaled_dot_product_attention(q, ka, va, scale=a.scale, mask=mask))
        mx.eval(outs)
        cache.trim(1)

    def mlp() -> None:
        mx.eval([layer.mlp(x) for layer in layers])

    def norms() -> None:
        mx.eval(
            [
                n(x)
                for layer in layers
                for n in (layer.input_layernorm, layer.post_attention_layernorm)
            ]
        )

    def head() -> None:
        mx.eval(m.logits(x[:, -1, :]))

    proj_mods = [
        getattr(ly.self_attn, p) for ly in layers for p in ("q_proj", "k_proj", "v_proj", "o_proj")
    ]
    if "head" in m:
        head_mods = [m.head]
    else:
        head_mods = [m.model.embed_tokens if m.args.tie_word_embeddings else m.lm_head]
    rows = [
        ("whole step (eval)", _best_of(full, reps), 0),
        ("  Python graph building", _best_of(build, reps), 0),
        ("  q/k/v/o projections x30", _best_of(attn_proj, reps), nbytes(proj_mods)),
        ("  MLP (gate, up, down) x30", _best_of(mlp, reps), nbytes([ly.mlp for ly in layers])),
        ("  RoPE + KV write + SDPA x30", _best_of(attn_core, reps), 0),
        ("  RMSNorm x60", _best_of(norms, reps), 0),
        ("  final norm + LM head", _best_of(head, reps), nbytes(head_mods)),
    ]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--decode", type=int, default=16, help="tokens per decode run")
    ap.add_argument("--prefill-rounds", type=int, default=1)
    ap.add_argument("--profile-plain", action="store_true", help="also profile the plain layout")
    ap.add_argument("--prompt", type=int, default=2000, help="prompt tokens for the prefill run")
    ap.add_argument(
        "--prefill-sdpa",
        action="store_true",
        help="also prefill with MLX's fused-op attention instead of the CPU prefill path",
    )
    args = ap.parse_args()

    t = time.perf_counter()
    lm = load()
    print(f"loaded {lm.name} ({lm.identity}) in {time.perf_counter() - t:.2f}s")
    chosen = [n for n, mod in lm.model.named_modules() if isinstance(mod, BlockedLinear)]
    print(
        f"CPU layout ({cpu_layout.mode()}): {len(chosen)} blocked modules "
        f"({'head' if 'head' in chosen else 'no head'})"
    )
    os.environ["CAIRN_CPU_LAYOUT"] = "0"
    plain = load()
    del os.environ["CAIRN_CPU_LAYOUT"]
    with tempfile.TemporaryDirectory() as d:
        save_folder(lm, d)
        sides = {"mlx-cairn": Ours(lm), "mlx-cairn, plain layout": Ours(plain), "mlx_lm": Theirs(d)}
    prefill_only = {"mlx-cairn, MLX SDPA": OursMlxSdpa(lm)} if args.prefill_sdpa else {}

    chat = "<|im_start|>user\nTell me a long story about a brave little cat.<|im_end|>\n<|im_start|>assistant\n"
    short = lm.tokenizer.encode(chat)
    long_prompt = (
        np.random.default_rng(0).integers(100, lm.model.vocab_size, size=args.prompt).tolist()
    )

    # Same weights, same layout: the greedy continuations agree.
    firsts = {name: [int(x) for x in side.stream(short, 16)] for name, side in sides.items()}
    print("greedy tokens agree:", len({tuple(v) for v in firsts.values()}) == 1)

    bw = copy_bandwidth()
    dec: dict[str, list[tuple[float, float]]] = {k: [] for k in sides}
    pre: dict[str, list[float]] = {k: [] for k in (*sides, *prefill_only)}
    names = list(sides)
    everyone = names + list(prefill_only)
    for r in range(args.rounds):
        # Rotate who goes first.
        order = everyone[r % len(everyone) :] + everyone[: r % len(everyone)]
        for name in order:
            side = sides.get(name) or prefill_only[name]
            if name in sides:
                dec[name].append(_timed_stream(side.stream(short, args.decode)))
            if r < args.prefill_rounds and "plain" not in name:  # the layout only matters for M = 1
                pre[name].append(_time_to_first(side.stream(long_prompt, 1), len(long_prompt)))
        print(
            f"round {r + 1}: " + ", ".join(f"{k} {dec[k][-1][0]:.2f}" for k in names) + " tok/s",
            flush=True,
        )
    bw = max(bw, copy_bandwidth())

    bpt = bytes_per_token(lm, len(short) + args.decode // 2)
    base = "mlx_lm"
    print()
    print(
        f"copy bandwidth {bw / 1e9:.1f} GB/s; {bpt / 1e6:.0f} MB read per decode token "
        f"-> roofline {bw / bpt:.1f} tok/s; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    print()
    print(
        "| side | decode tok/s best | median | CPU ms/token | vs mlx_lm (median of rounds) | of roofline | "
        f"prefill {args.prompt} tok/s best | vs mlx_lm |"
    )
    print("|---|---|---|---|---|---|---|---|")
    best_dec = {k: max(x[0] for x in v) for k, v in dec.items()}
    best_pre = {k: max(v) if v else float("nan") for k, v in pre.items()}
    for name in sides:
        tps = [x[0] for x in dec[name]]
        cpu_ms = statistics.median(x[1] for x in dec[name])
        ratio = statistics.median(a[0] / b[0] for a, b in zip(dec[name], dec[base], strict=True))
        print(
            f"| {name} | {best_dec[name]:.2f} | {statistics.median(tps):.2f} | {cpu_ms:.0f} | "
            f"{ratio:.2f}x | {best_dec[name] * bpt / bw:.0%} | "
            f"{best_pre[name]:.1f} | {best_pre[name] / best_pre[base]:.2f}x |"
        )
    for name in prefill_only:
        print(
            f"| {name} | | | | | | {best_pre[name]:.1f} | {best_pre[name] / best_pre[base]:.2f}x |"
        )
    if pre["mlx-cairn"] and len(pre) > 1:
        per_round = {k: v for k, v in pre.items() if v}
        print(
            "prefill tok/s per round: "
            + "; ".join(f"{k} " + ", ".join(f"{x:.1f}" for x in v) for k, v in per_round.items())
        )

    for label, model in (("mlx-cairn", lm), ("plain layout", plain))[
        : 2 if args.profile_plain else 1
    ]:
        print()
        print(f"profile of one decode step, {label} (best of 5, context 128):")
        print("| part | ms | weights MB | GB/s |")
        print("|---|---|---|---|")
        for part, sec, nb in profile_step(model):
            gbs = f"{nb / sec / 1e9:.1f}" if nb else ""
            mb = f"{nb / 1e6:.0f}" if nb else ""
            print(f"| {part} | {sec * 1e3:.1f} | {mb} | {gbs} |")


if __name__ == "__main__":
    main()

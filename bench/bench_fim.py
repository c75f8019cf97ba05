"""Keystroke-style fill-in-the-middle over HTTP: does each keystroke reuse the last prompt? (issue 36)

Editor autocomplete sends the code around the cursor on every keystroke, each
prompt the last one plus a few characters. This benchmark builds a code
model with Qwen2.5-Coder's FIM tokens (none ships on PyPI: random weights,
mlx-lm's ``qwen2`` class, about 30M parameters, and a byte-level BPE trained
here on the Python standard library's own source, with Qwen's special and
FIM tokens), saves it as a Hugging Face folder and starts ``cairn serve`` on
it. Then, over streamed ``POST /v1/completions`` with a ``suffix``:

- cold: ``--cold`` requests, each with its own ``cache_salt`` (nothing can be
  reused), a prefix of about ``--prefix-tokens`` tokens of real code and a
  suffix of about ``--suffix-tokens``;
- keystrokes: ``--keystrokes`` requests in a row, request ``i`` typing
  ``--chars`` more characters of the file at the cursor (the suffix stays);
  the first one is cold, the rest may reuse the last prompt.

It reports TTFT (client side: request sent to first answer chunk) p50 of
both, their ratio (the bar: at most 0.2), the server's own figures (its
``usage.timings.ttft_ms`` and the cached prompt tokens of each answer).

Run (about a minute on 2 shared cores)::

    .venv/bin/python bench/bench_fim.py
    .venv/bin/python bench/bench_fim.py --prefix-tokens 6000 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

# isort: off
import mlx_cairn  # noqa: F401  (loads the optimized BLAS before mlx.core)

# isort: on
import httpx

from serve_proc import TOKEN, free_port, wait_ready  # bench/ is on sys.path

#: Qwen2.5-Coder's special tokens (FIM, repository context, ChatML).
SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
]  # fmt: skip
#: Standard-library modules whose source trains the tokenizer and is the code typed.
SOURCES = ["argparse", "textwrap", "json/decoder", "dataclasses", "functools", "statistics"]


def code() -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return "\n".join((stdlib / f"{m}.py").read_text() for m in SOURCES)


def build_model(folder: Path, args: argparse.Namespace) -> Any:
    """A random-weight Qwen2 coder model with FIM tokens, saved as an HF folder."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from mlx_cairn.chat.builtin_templates import CHATML
    from mlx_cairn.chat.tokenizer import Tokenizer
    from mlx_cairn.models.export import save_folder
    from mlx_cairn.models.loaded import assemble
    from mlx_cairn.models.zoo import ZooModel
    from mlx_cairn.models.zoo import build_model as build_zoo
    from mlx_cairn.testing.tiny_models import random_weights

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIALS,
        show_progress=False,
    )
    hf.train_from_iterator([code()], trainer)
    tok = Tokenizer(hf, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    config = {
        "model_type": "qwen2",
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "intermediate_size": args.hidden * 3,
        "num_attention_heads": args.hidden // 64,
        "num_key_value_heads": 2,
        "vocab_size": tok.vocab_size,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "rope_theta": 1e6,
        "tie_word_embeddings": True,
    }
    inner = build_zoo(config, None)
    random_weights(inner, seed=0)
    lm = assemble(
        name="tiny-coder",
        model=ZooModel(inner, config),
        tokenizer=tok,
        template_source=CHATML,
        eos_token_ids={tok.token_to_id("<|endoftext|>")},
        context_length=config["max_position_embeddings"],
        identity="bench-fim-coder:float32",
        source_format="memory",
    )
    save_folder(lm, folder)
    return tok


def fit(tok: Any, text: str, tokens: int, *, from_end: bool = False) -> str:
    """The longest whole-line piece of ``text`` (its start, or its end) of at most ``tokens``."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    for line in reversed(lines) if from_end else lines:
        if len(tok.encode_plain("".join(out) + line)) > tokens:
            break
        out.append(line)
    return "".join(reversed(out) if from_end else out)


def request(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed completion: client TTFT, and the usage the server reported."""
    t0 = time.perf_counter()
    first: float | None = None
    usage: dict[str, Any] = {}
    with httpx.stream(
        "POST", url + "/v1/completions", json=body, headers={"x-api-key": TOKEN}, timeout=600
    ) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()}")
        for line in r.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter()
            usage = chunk.get("usage") or usage
    assert first is not None
    return {
        "ttft_ms": 1000 * (first - t0),
        "server_ttft_ms": usage["timings"]["ttft_ms"],
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--prefix-tokens", type=int, default=3000, help="code before the cursor")
    ap.add_argument("--suffix-tokens", type=int, default=200, help="code after the cursor")
    ap.add_argument("--keystrokes", type=int, default=30, help="requests, each typing more")
    ap.add_argument("--chars", type=int, default=3, help="characters typed per keystroke")
    ap.add_argument("--cold", type=int, default=5, help="requests that reuse nothing")
    ap.add_argument("--max-tokens", type=int, default=8, help="generated tokens per request")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--server-log", type=Path, default=Path(tempfile.gettempdir()) / "cairn-fim.log"
    )
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "tiny-coder"
        tok = build_model(folder, args)
        text = code()
        cut = len(fit(tok, text, args.prefix_tokens))
        typed = text[cut : cut + args.keystrokes * args.chars]
        prefix = text[:cut]
        suffix = fit(tok, text[cut + len(typed) :], args.suffix_tokens)
        # No end of text nor end of middle: every answer runs to max_tokens.
        stops = ["<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|fim_prefix|>"]
        bias = {str(tok.token_to_id(t)): -100 for t in stops}

        def body(pre: str, salt: str) -> dict[str, Any]:
            return {
                "model": "tiny-coder",
                "prompt": pre,
                "suffix": suffix,
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
                "logit_bias": bias,
                "cache_salt": salt,
            }

        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "mlx_cairn.cli", "serve", "--host", "127.0.0.1",
               "--port", str(port), "--log-level", "warning", "--model", str(folder),
               "--preload", "--kv-cache-gb", "1"]  # fmt: skip
        env = dict(os.environ, CAIRN_API_KEY=TOKEN)
        proc = subprocess.Popen(
            cmd, env=env, stdout=args.server_log.open("wb"), stderr=subprocess.STDOUT
        )
        try:
            wait_ready(url, proc)
            request(url, body("def f():\n", "warm-up"))  # first-call costs out of the way
            cold = [request(url, body(prefix, uuid.uuid4().hex)) for _ in range(args.cold)]
            salt = uuid.uuid4().hex
            keys = [
                request(url, body(prefix + typed[: i * args.chars], salt))
                for i in range(args.keystrokes)
            ]
        finally:
            proc.terminate()
            proc.wait(timeout=30)

    def p50(rows: list[dict[str, Any]], key: str) -> float:
        return round(statistics.median(r[key] for r in rows), 1)

    reuse = keys[1:]  # the first keystroke is itself cold
    out = {
        "prompt_tokens": [cold[0]["prompt_tokens"], keys[-1]["prompt_tokens"]],
        "cold_ttft_p50_ms": p50(cold, "ttft_ms"),
        "keystroke_ttft_p50_ms": p50(reuse, "ttft_ms"),
        "ratio": round(p50(reuse, "ttft_ms") / p50(cold, "ttft_ms"), 3),
        "cold_server_ttft_p50_ms": p50(cold, "server_ttft_ms"),
        "keystroke_server_ttft_p50_ms": p50(reuse, "server_ttft_ms"),
        "keystroke_cached_tokens_p50": p50(reuse, "cached_tokens"),
        "cold_cached_tokens": [r["cached_tokens"] for r in cold],
        "keystroke_ttft_ms": [round(r["ttft_ms"]) for r in keys],
    }
    print(json.dumps(out, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

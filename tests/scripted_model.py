"""A deterministic test model: the forward pass is replaced, everything else is real.

:func:`scripted_model` returns a LoadedModel whose tokenizer and chat template
(Qwen3 style: hermes tool calls, ``<think>`` reasoning) are the real ones of
``mlx_cairn.testing.tiny_models``; only the network is swapped for
:class:`ScriptedNet`, which implements the ``models/base.py`` Model protocol.

What it says is written in the prompt: the last ``say:<base64>`` directive in the
conversation is decoded, tokenized with the real tokenizer, and emitted one
token per step, then EOS. Without a directive it says ``ok``. So the engine,
the paged KV cache, the sampler, the Rust text pipeline and the HTTP layer all
run for real, on an output the test chose::

    lm = scripted_model()
    say("<think>plan</think>Hello")   # -> "say:PHRoaW5rPnBsYW48L3RoaW5rPkhlbGxv"

How it knows where generation stands: it stores each token id in its KV cache
(key channel 0), so every forward call sees the whole token history through
``cache.update_and_fetch``. Output so far = the tokens after the last
``<|im_start|>assistant\\n`` (and the empty ``<think>`` block the template adds
when reasoning is off).
"""

from __future__ import annotations

import base64
import re
import threading
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_cairn.testing.tiny_models import tiny_model

_DIRECTIVE = re.compile(r"say:([A-Za-z0-9+/=]*)")


def say(text: str) -> str:
    """The directive that makes the scripted model answer ``text``."""
    return "say:" + base64.b64encode(text.encode()).decode()


class ScriptedNet:
    """Model protocol implementation whose next token is a function of the history."""

    num_layers = 1
    num_kv_heads = 1
    head_dim = 2
    dtype = mx.float32

    def __init__(self, tokenizer: Any, eos_id: int, vocab_size: int) -> None:
        self.tok = tokenizer
        self.eos = eos_id
        self.vocab_size = vocab_size
        self.im_start = tokenizer.token_to_id("<|im_start|>")
        self._heads = [
            tokenizer.encode("assistant\n<think>\n\n</think>\n\n"),
            tokenizer.encode("assistant\n"),
        ]
        self._memo: dict[tuple[int, ...], list[int]] = {}
        self._lock = threading.Lock()

    def __call__(self, tokens: mx.array, cache: Any) -> mx.array:
        b, n = tokens.shape
        k = mx.broadcast_to(tokens.astype(mx.float32)[:, None, :, None], (b, 1, n, self.head_dim))
        k_all, _, _ = cache.update_and_fetch(0, k, k)
        hist = np.array(k_all[:, 0, :, 0]).astype(np.int64)
        offsets = np.array(cache.offsets).astype(np.int64)
        out = np.zeros((b, n, 1), dtype=np.float32)
        # Every position gets its next token: in a batched prefill rows are
        # right-padded to the longest chunk, and the engine reads each row's
        # logits at its own last real position, not at the last column.
        for row in range(b):
            full = hist[row, : offsets[row] + n].tolist()
            first = int(offsets[row])
            # The last <|im_start|> before this chunk, then kept up to date per
            # position: linear in the chunk, so 64k-token prompts stay fast.
            start = _last_index(full[: first + 1], self.im_start)
            for j in range(n):
                end = first + j + 1
                if full[end - 1] == self.im_start:
                    start = end - 1
                out[row, j, 0] = self._next(full, end, start)
        return mx.array(out)

    def logits(self, hidden: mx.array) -> mx.array:
        ids = hidden[..., 0].astype(mx.int32)
        hot = mx.arange(self.vocab_size)[None, :] == ids[..., None]
        return mx.where(hot, 50.0, -50.0).astype(mx.float32)

    def next_token(self, ids: list[int]) -> int:
        """The scripted continuation of ``ids`` (the whole history of one row)."""
        return self._next(ids, len(ids), _last_index(ids, self.im_start))

    def _next(self, ids: list[int], end: int, start: int) -> int:
        """The continuation of ``ids[:end]`` whose last ``<|im_start|>`` is at ``start``."""
        if start < 0:
            return self.eos
        for head in self._heads:
            cut = start + 1 + len(head)
            if cut <= end and ids[start + 1 : cut] == head:
                break
        else:
            return self.eos
        script = self._script(ids[:cut])
        k = end - cut
        return script[k] if k < len(script) else self.eos

    def _script(self, prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        with self._lock:
            hit = self._memo.get(key)
        if hit is not None:
            return hit
        found = _DIRECTIVE.findall(self.tok.decode(prompt, skip_special_tokens=False))
        text = base64.b64decode(found[-1]).decode() if found else "ok"
        ids = self.tok.encode(text)
        with self._lock:
            self._memo[key] = ids
        return ids


def _last_index(ids: list[int], token: int) -> int:
    """Index of the last ``token`` in ``ids``, -1 if none."""
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == token:
            return i
    return -1


def scripted_model(name: str = "scripted", context_length: int = 8192) -> Any:
    """A LoadedModel (Qwen3-style template, real tiny tokenizer) driven by ScriptedNet.

    The tiny tokenizer spends many tokens on English, so the context is larger
    than the tiny models' (the scripted net has no position limit).
    """
    lm = tiny_model("qwen3")
    lm.context_length = context_length
    eos = lm.tokenizer.token_to_id("<|im_end|>")
    assert eos is not None
    lm.model = ScriptedNet(lm.tokenizer, eos, lm.model.vocab_size)
    lm.name = name
    lm.identity = f"{name}:scripted"
    return lm

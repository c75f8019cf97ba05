"""Tiny random-weight models built in-process, for tests everywhere in the project.

Example::

    from mlx_cairn.testing.tiny_models import tiny_model
    lm = tiny_model("qwen3", seed=0)     # a LoadedModel, ready in milliseconds
    ids = lm.prompt(ChatRequest(messages=[Message("user", "Hi")])).ids

The tokenizer is a real byte-level BPE trained in-process on a fixed corpus
(deterministic), with ChatML specials and ``<think>`` / ``<tool_call>`` tags.
"""

from __future__ import annotations

from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from mlx_cairn.chat.builtin_templates import CHATML, QWEN3
from mlx_cairn.chat.tokenizer import Tokenizer
from mlx_cairn.models.llama import LlamaModel, ModelArgs
from mlx_cairn.models.loaded import LoadedModel, assemble

Arch = Literal["llama", "qwen2", "qwen3"]

_CORPUS = [
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\nThe capital of France is Paris.<|im_end|>\n",
    "Hello world! How are you today? I am fine, thank you. 0123456789 " * 2,
    'def add(x, y):\n    return x + y\n\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n',
    "tool_call tool_response tools function arguments parameters description",
    "héllo wörld — ünïcode ✓ 日本語 😀",
]
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]

#: Model vocabulary (padded above the tokenizer's, as real checkpoints often are).
TINY_VOCAB = 384


def trained_bpe(vocab_size: int, specials: list[str]) -> HFTokenizer:
    """A byte-level BPE of ``vocab_size`` tokens trained on the tiny corpus (deterministic)."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=specials,
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    return tok


def tiny_tokenizer() -> Tokenizer:
    """A deterministic byte-level BPE with ChatML specials (about 370 tokens)."""
    tok = trained_bpe(360, _SPECIALS)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in _TAGS])
    return Tokenizer(tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def _tiny_eos(tok: Tokenizer) -> set[int]:
    """The ids that end a tiny model's turn: ``<|im_end|>`` and ``<|endoftext|>``."""
    ids = (tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>"))
    return {i for i in ids if i is not None}


def tiny_args(arch: Arch = "llama") -> ModelArgs:
    """Small but structurally faithful hyper-parameters for ``arch``."""
    common: dict[str, Any] = dict(
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=TINY_VOCAB,
        rms_norm_eps=1e-5,
        max_position_embeddings=2048,
    )
    if arch == "llama":
        rope = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        }
        return ModelArgs(
            model_type="llama",
            rope_theta=10000.0,
            rope_scaling=rope,
            tie_word_embeddings=False,
            **common,
        )
    if arch == "qwen2":
        return ModelArgs(model_type="qwen2", rope_theta=1e6, tie_word_embeddings=True, **common)
    if arch == "qwen3":
        # head_dim * heads != hidden_size, as in the real Qwen3 models.
        return ModelArgs(
            model_type="qwen3", rope_theta=1e6, tie_word_embeddings=True, head_dim=32, **common
        )
    raise ValueError(f"unknown tiny architecture {arch!r}")


def random_weights(model: nn.Module, seed: int) -> None:
    """Fill ``model`` with deterministic random fp32 weights."""
    rng = np.random.default_rng(seed)
    params = []
    flat: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    for name, p in flat:
        if "norm" in name:
            w = 1.0 + 0.1 * rng.standard_normal(p.shape)
        elif name.endswith("bias"):
            w = 0.02 * rng.standard_normal(p.shape)
        else:
            # Large enough that logits are far from uniform, so greedy paths are stable.
            w = rng.standard_normal(p.shape) / np.sqrt(p.shape[-1])
        params.append((name, mx.array(np.asarray(w, dtype=np.float32))))
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())


def tiny_model(arch: Arch = "llama", seed: int = 0, *, noise: float = 0.0) -> LoadedModel:
    """A random-weight ``arch`` model with a real tokenizer and chat template.

    ``noise``: gaussian noise of that relative size on its matrices (a draft model
    for the model of the same seed that agrees with it often, not always)."""
    args = tiny_args(arch)
    model = LlamaModel(args)
    random_weights(model, seed)
    if noise:
        rng = np.random.default_rng(seed + 1)
        flat: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
        noisy = [
            (k, w + noise * float(w.std()) * mx.array(rng.standard_normal(w.shape), mx.float32))
            if w.ndim == 2
            else (k, w)
            for k, w in flat
        ]
        model.update(tree_unflatten(noisy))
        mx.eval(model.parameters())
    tok = tiny_tokenizer()
    eos = _tiny_eos(tok)
    return assemble(
        name=f"tiny-{arch}",
        model=model,
        tokenizer=tok,
        template_source=CHATML if arch == "llama" else QWEN3,
        eos_token_ids=eos,
        context_length=args.max_position_embeddings,
        identity=f"tiny-{arch}-seed{seed}{f'-noise{noise}' if noise else ''}:float32",
        source_format="memory",
    )


def tiny_zoo_model(model_type: str, seed: int = 0, **overrides: Any) -> LoadedModel:
    """A random-weight mlx-lm ``model_type`` (:mod:`mlx_cairn.testing.tiny_configs`) as a LoadedModel.

    The model is mlx-lm's own class, wrapped by :class:`mlx_cairn.models.zoo.ZooModel`;
    ``overrides`` replace config entries.
    """
    from mlx_cairn.models.zoo import ZooModel, build_model
    from mlx_cairn.testing.tiny_configs import tiny_config

    config = {**tiny_config(model_type), **overrides}
    inner = build_model(config, None)
    random_weights(inner, seed)
    model = ZooModel(inner, config)
    tok = tiny_tokenizer()
    eos = _tiny_eos(tok)
    return assemble(
        name=f"tiny-{model_type}",
        model=model,
        tokenizer=tok,
        template_source=QWEN3,
        eos_token_ids=eos,
        context_length=int(config["max_position_embeddings"]),
        identity=f"tiny-{model_type}-seed{seed}:float32",
        source_format="memory",
    )


def mlx_lm_greedy(inner: Any, prompt: list[int], max_tokens: int, eos: set[int]) -> list[int]:
    """mlx-lm's own single-sequence greedy generation: its model, its caches, the whole
    prompt at once, argmax (the reference the engine is compared with; EOS kept)."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_cairn.backends.cpu import attention as cpu_attention

    out: list[int] = []
    with cpu_attention.disabled():  # mlx-lm's own attention, even in patched modules
        cache = make_prompt_cache(inner)
        logits = inner(mx.array([prompt], dtype=mx.int32), cache=cache)[:, -1, :]
        while len(out) < max_tokens:
            tok = int(mx.argmax(logits, axis=-1).item())  # type: ignore[arg-type]
            out.append(tok)
            if tok in eos:
                break
            logits = inner(mx.array([[tok]], dtype=mx.int32), cache=cache)[:, -1, :]
    return out

"""A tiny long-context model for driving the real Claude Code CLI on a CPU.

Claude Code's first request is 12k-32k tokens (system prompt, environment
block, tool schemas), so the model needs a context of at least 64k, a prefill
of that size that takes seconds on two cores, and a real vocabulary:

- vocabulary: SmolLM2's 49k-token byte-level BPE and ChatML template, read
  from the embedded default GGUF's metadata. ``tiny_tokenizer()`` (about 370
  tokens, trained on five lines) is a real BPE too, but it spends ~2.5x more
  tokens on the same prompt (40k instead of 16k for the 12-tool fixture), and
  prefill attention grows with the square of that.
- size: one layer, two query heads, one KV head, hidden size 64: about 6M
  parameters, almost all in the embedding and the LM head.
- context: ``max_position_embeddings`` = 131072 in config.json, which is what
  the HF loader reports as ``context_length``.
- ending: a random model almost never samples its EOS token (1 in 49k), and
  Claude Code treats a reply cut at ``max_tokens`` as an error ("API Error:
  Claude's response exceeded the N output token maximum", exit 1). So the
  weights are random except for a bigram path planted on top of them: the
  embedding of each token of ``"\\n" + REPLY`` is a large one-hot vector and
  the LM head maps it to the next token of the reply, the last one to
  ``<|im_end|>``. The generation prompt ends with "\\n", so every answer is
  REPLY (whatever the temperature: the margin is ~30 logits), ended by EOS.
  REPLY is the tokenizer's own encoding of a sentence of distinct tokens, so
  a later turn that re-sends it tokenizes to the same ids (a random token
  sequence would not: BPE re-encodes it differently, and the prefix cache
  could not hit past it). It is 20 tokens long, so it crosses a 16-token KV
  block boundary and a prefix hit can be seen to cover it.

The layers stay random and run at full cost: attention still reads all 30k
positions; only their contribution to the output is drowned.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from mlx_cairn.chat.gguf_tokenizer import tokenizer_from_gguf
from mlx_cairn.models.export import save_folder
from mlx_cairn.models.llama import LlamaModel
from mlx_cairn.models.loaded import assemble
from mlx_cairn.models.loader import default_model_path, load
from mlx_cairn.testing.tiny_models import random_weights, tiny_args

#: What the model answers to any prompt (20 distinct SmolLM2 tokens).
REPLY = "Hello! I am a tiny random-weight test model; my weights spell out this short reply."
CONTEXT = 131072
#: Size of the planted one-hot embeddings; the layers' random output is O(1).
_EMBED_SCALE = 100.0
#: LM-head weight of each planted transition (logit ~ 8 * this after RMSNorm).
_HEAD_WEIGHT = 4.0


def export_tiny_long(folder: str | Path, *, seed: int = 0) -> Path:
    """Write the model as a Hugging Face folder and check that it loads back as specified."""
    import mlx.core as mx  # here, after mlx_cairn has loaded the optimized BLAS (docs/design.md §5)

    _, meta = mx.load(str(default_model_path()), return_metadata=True)
    tok = tokenizer_from_gguf(meta)  # type: ignore[arg-type]
    eos = int(meta["tokenizer.ggml.eos_token_id"].item())  # type: ignore[index,call-overload]
    args = dataclasses.replace(
        tiny_args("llama"),
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=tok.vocab_size,
        max_position_embeddings=CONTEXT,
    )
    model = LlamaModel(args)
    random_weights(model, seed)
    chain = [*tok.encode("\n"), *tok.encode(REPLY), eos]
    sources = chain[:-1]
    if len(set(sources)) != len(sources) or len(sources) > args.hidden_size:
        raise ValueError("the planted reply needs distinct tokens, at most one per hidden dim")
    embed = np.array(model.model.embed_tokens.weight)
    head = np.array(model.lm_head.weight)
    head[:, : len(sources)] = 0.0
    for dim, (src, dst) in enumerate(zip(sources, chain[1:], strict=True)):
        embed[src] = 0.0
        embed[src, dim] = _EMBED_SCALE
        head[dst, dim] = _HEAD_WEIGHT
    model.model.embed_tokens.weight = mx.array(embed)
    model.lm_head.weight = mx.array(head)
    lm = assemble(
        name="tiny-long",
        model=model,
        tokenizer=tok,
        template_source=str(meta["tokenizer.chat_template"]),
        eos_token_ids={eos},
        context_length=CONTEXT,
        identity=f"tiny-long-seed{seed}:float32",
        source_format="memory",
    )
    out = save_folder(lm, folder)
    back = load(str(out))
    if back.context_length != CONTEXT:
        raise AssertionError(f"loader reads context_length {back.context_length}, not {CONTEXT}")
    return out

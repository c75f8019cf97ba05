"""Helpers shared by the model tests: a tiny GGUF writer and the default-model fixture."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_cairn.models.loaded import LoadedModel


def _permute(w: mx.array, n_heads: int) -> mx.array:
    """HF split-half RoPE rows -> GGUF interleaved rows (llama.cpp's convert permute)."""
    out = w.shape[0]
    return w.reshape(n_heads, 2, out // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def write_tiny_gguf(lm: LoadedModel, path: Path) -> Path:
    """Write a tiny Llama (HF layout in memory) as a GGUF file the way llama.cpp would."""
    args = lm.model.args
    assert args.model_type == "llama"
    tensors = {}
    for k, v in tree_flatten(lm.model.parameters()):
        if k.startswith("model.layers."):
            _, _, i, rest = k.split(".", 3)
            mod, kind = rest.rsplit(".", 1)
            if mod == "self_attn.q_proj":
                v = _permute(v, args.num_attention_heads)
            elif mod == "self_attn.k_proj":
                v = _permute(v, args.num_key_value_heads)
            tensors[f"blk.{i}.{_NAMES[mod]}.{kind}"] = v
        elif k == "model.embed_tokens.weight":
            tensors["token_embd.weight"] = v
        elif k == "model.norm.weight":
            tensors["output_norm.weight"] = v
        elif k == "lm_head.weight":
            tensors["output.weight"] = v
    rope = lm.model.model.layers[0].self_attn.rope
    if rope._freqs is not None:
        # llama.cpp stores llama3 RoPE scaling as per-frequency factors.
        d = args.head_dim
        tensors["rope_freqs.weight"] = rope._freqs / (args.rope_theta ** (mx.arange(0, d, 2) / d))
    tok = json.loads(lm.tokenizer.hf.to_str())
    vocab = tok["model"]["vocab"]
    for a in tok["added_tokens"]:
        vocab[a["content"]] = a["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"]: a["special"] for a in tok["added_tokens"]}
    types = [3 if special.get(t) else 4 if t in special else 1 for t in tokens]
    merges = [" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]]
    u32 = lambda x: mx.array(x, dtype=mx.uint32)  # noqa: E731
    meta = {
        "general.architecture": "llama",
        "general.name": "tiny",
        "llama.embedding_length": u32(args.hidden_size),
        "llama.block_count": u32(args.num_hidden_layers),
        "llama.feed_forward_length": u32(args.intermediate_size),
        "llama.attention.head_count": u32(args.num_attention_heads),
        "llama.attention.head_count_kv": u32(args.num_key_value_heads),
        "llama.attention.layer_norm_rms_epsilon": mx.array(args.rms_norm_eps, dtype=mx.float32),
        "llama.rope.freq_base": mx.array(args.rope_theta, dtype=mx.float32),
        "llama.context_length": u32(args.max_position_embeddings),
        "llama.vocab_size": u32(args.vocab_size),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": mx.array(types, dtype=mx.int32),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": u32(vocab["<|im_end|>"]),
        "tokenizer.ggml.bos_token_id": u32(vocab["<|im_start|>"]),
        "tokenizer.ggml.add_bos_token": mx.array(False),
        "tokenizer.chat_template": lm.template.source,
    }
    mx.save_gguf(str(path), tensors, meta)
    return path

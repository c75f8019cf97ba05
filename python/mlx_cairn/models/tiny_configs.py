"""Tiny ``config.json`` dicts for mlx-lm architectures: small dims, real config shapes.

Each keeps what makes its family different (GQA, q/k norms, MoE routing and
shared experts, sliding-window layer patterns, attention sinks, MLA latent
dims, NoPE layers, logit scaling), at sizes that build and run in
milliseconds on a CPU. Windows are a few tokens so test prompts cross them.

Example::

    from mlx_cairn.models.testing import tiny_zoo_model
    lm = tiny_zoo_model("gemma3_text", seed=0)
"""

from __future__ import annotations

import copy
from typing import Any

#: Vocabulary of every tiny model (the tiny tokenizer's ~370 ids, padded).
VOCAB = 384

_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}

_MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True}

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    },
    # Mistral checkpoints say "mistral"; mlx-lm remaps it to its llama module.
    "mistral": {"rope_theta": 1e6, "head_dim": 32},
    "ministral3": {
        "num_hidden_layers": 3,
        "head_dim": 16,
        "tie_word_embeddings": True,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "sliding_window": 8,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1e6,
            "factor": 16.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.1,
        },
    },
    "qwen2": {"rope_theta": 1e6, "tie_word_embeddings": True},
    "qwen3": {"rope_theta": 1e6, "head_dim": 32, "tie_word_embeddings": True},
    "qwen3_moe": {
        **_MOE,
        "head_dim": 16,
        "num_experts": 4,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "gemma3_text": {
        "num_hidden_layers": 3,
        "head_dim": 16,
        "num_key_value_heads": 1,
        "query_pre_attn_scalar": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "rope_local_base_freq": 10000.0,
        "sliding_window": 8,
        "sliding_window_pattern": 3,
    },
    "phi3": {"num_key_value_heads": 4, "partial_rotary_factor": 0.75},
    "gpt_oss": {
        "num_hidden_layers": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 32,
        "head_dim": 16,
        "sliding_window": 8,
        "rope_theta": 150000,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "glm4_moe": {
        **_MOE,
        "num_hidden_layers": 3,
        "head_dim": 16,
        "n_group": 1,
        "topk_group": 1,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "routed_scaling_factor": 1.5,
        "first_k_dense_replace": 1,
        "rope_scaling": None,
        "use_qk_norm": True,
        "attention_bias": True,
        "partial_rotary_factor": 0.5,
    },
    "deepseek_v3": {
        **_MOE,
        "num_hidden_layers": 3,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 32,
        "q_lora_rank": 48,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "qk_nope_head_dim": 16,
        "n_group": 2,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_key_value_heads": 4,
    },
    "olmo2": {"tie_word_embeddings": False},
    "granite": {
        "logits_scaling": 4.0,
        "attention_multiplier": 0.125,
        "embedding_multiplier": 6.0,
        "residual_multiplier": 0.5,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "rope_theta": 1e6},
    "smollm3": {
        "num_hidden_layers": 4,
        "no_rope_layer_interval": 4,
        "tie_word_embeddings": True,
    },
}


#: Multimodal checkpoints whose text model is another entry (vision weights absent).
WRAPPERS = {"gemma3": "gemma3_text", "mistral3": "ministral3"}


def tiny_config(model_type: str) -> dict[str, Any]:
    """A fresh copy of the tiny config of ``model_type`` (with ``model_type`` set)."""
    if model_type in WRAPPERS:
        text = tiny_config(WRAPPERS[model_type])
        return {
            "model_type": model_type,
            "text_config": text,
            "vocab_size": VOCAB,
            "max_position_embeddings": text["max_position_embeddings"],
        }
    if model_type not in TINY_CONFIGS:
        raise ValueError(f"no tiny config for {model_type!r}; have {', '.join(TINY_CONFIGS)}")
    out = copy.deepcopy(_COMMON)
    out.update(copy.deepcopy(TINY_CONFIGS[model_type]))
    out["model_type"] = model_type
    return out

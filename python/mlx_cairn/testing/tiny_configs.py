"""Tiny ``config.json`` dicts for mlx-lm architectures: small dims, real config shapes.

Each keeps what makes its family different (GQA, q/k norms, MoE routing and
shared experts, sliding-window layer patterns, attention sinks, MLA latent
dims, NoPE layers, logit scaling), at sizes that build and run in
milliseconds on a CPU. Windows are a few tokens so test prompts cross them.

Example::

    from mlx_cairn.testing.tiny_models import tiny_zoo_model
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


_LINEAR = {
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 2,
    "head_dim": 16,
}
_QWEN_MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "shared_expert_intermediate_size": 32,
    "moe_intermediate_size": 32,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
}
#: Qwen3.5 checkpoints nest their text model's config (the vision tower is absent here).
_QWEN35_TEXT = {
    **_LINEAR,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
}
_MAMBA = {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8, "mamba_d_conv": 4}

#: Hybrids: recurrent-state layers (Gated DeltaNet, Mamba 2, short convolutions)
#: between attention layers (issue 15).
HYBRID_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_next": {
        **_LINEAR,
        **_QWEN_MOE,
        "num_hidden_layers": 4,
        "rope_theta": 1e6,
        "partial_rotary_factor": 0.25,
    },
    "qwen3_5": {
        "num_hidden_layers": 4,
        "text_config": {
            **_QWEN35_TEXT,
            "rope_parameters": {
                "type": "default",
                "mrope_section": [1, 1, 0],
                "rope_theta": 1e6,
                "partial_rotary_factor": 0.25,
            },
        },
    },
    "qwen3_5_moe": {
        "num_hidden_layers": 4,
        "text_config": {**_QWEN35_TEXT, **_QWEN_MOE},
    },
    "lfm2": {
        "num_hidden_layers": 4,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 64,
        "block_ff_dim": 128,
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "full_attn_idxs": [1, 3],
    },
    "lfm2_moe": {
        "num_hidden_layers": 4,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "num_dense_layers": 1,
        "norm_topk_prob": True,
        "use_expert_bias": True,
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
    },
    "nemotron_h": {
        "num_hidden_layers": 4,
        "hybrid_override_pattern": ["M", "*", "M", "-"],
        "attention_bias": False,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "mamba_proj_bias": False,
        "ssm_state_size": 8,
        "conv_kernel": 4,
        "n_groups": 2,
        "mlp_bias": False,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
        "head_dim": 16,
    },
    "granitemoehybrid": {
        **_MAMBA,
        "num_hidden_layers": 4,
        "attention_bias": False,
        "embedding_multiplier": 6.0,
        "attention_multiplier": 0.125,
        "logits_scaling": 4.0,
        "residual_multiplier": 0.5,
        "layer_types": ["mamba", "attention", "mamba", "attention"],
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "shared_intermediate_size": 64,
        "mamba_proj_bias": False,
        "mamba_n_groups": 1,
        "mamba_conv_bias": True,
        "position_embedding_type": "rope",
    },
    "mamba": {
        "num_hidden_layers": 2,
        "state_size": 8,
        "conv_kernel": 4,
        "use_bias": False,
        "use_conv_bias": True,
        "time_step_rank": 4,
        "tie_word_embeddings": True,
    },
    "mamba2": {
        "num_hidden_layers": 2,
        "num_heads": 4,
        "head_dim": 32,
        "state_size": 8,
        "n_groups": 1,
        "conv_kernel": 4,
        "expand": 2,
        "use_bias": False,
        "use_conv_bias": True,
        "layer_norm_epsilon": 1e-5,
        "time_step_limit": [0.0, 100.0],
        "time_step_rank": 8,
        "tie_word_embeddings": True,
    },
    "falcon_h1": {
        "num_hidden_layers": 2,
        "head_dim": 16,
        "mamba_d_conv": 4,
        "mamba_d_head": 16,
        "mamba_d_ssm": 64,
        "mamba_d_state": 8,
        "mamba_n_heads": 4,
        "mamba_n_groups": 1,
        "mamba_chunk_size": 16,
        "rope_theta": 1e6,
        "embedding_multiplier": 1.0,
        "lm_head_multiplier": 1.0,
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
    table = {**TINY_CONFIGS, **HYBRID_CONFIGS}
    if model_type not in table:
        raise ValueError(f"no tiny config for {model_type!r}; have {', '.join(table)}")
    out = copy.deepcopy(_COMMON)
    out.update(copy.deepcopy(table[model_type]))
    out["model_type"] = model_type
    return out

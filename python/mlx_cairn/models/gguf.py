"""Load a GGUF file: weights via ``mx.load``, tokenizer and template from its metadata.

GGUF names map onto the HF module names the architecture uses::

    token_embd            -> model.embed_tokens
    blk.N.attn_q / _k / _v / _output -> model.layers.N.self_attn.{q,k,v,o}_proj
    blk.N.attn_q_norm / attn_k_norm  -> ...self_attn.{q,k}_norm   (Qwen3)
    blk.N.ffn_gate / _up / _down     -> ...mlp.{gate,up,down}_proj
    blk.N.attn_norm / ffn_norm       -> ...input_layernorm / post_attention_layernorm
    output_norm / output             -> model.norm / lm_head

llama.cpp permutes Llama Q/K rows into the interleaved RoPE order, so GGUF
Llama models run with ``rope_traditional=True``; Qwen GGUFs keep the HF order.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_cairn.chat.builtin_templates import CHATML
from mlx_cairn.chat.gguf_tokenizer import tokenizer_from_gguf
from mlx_cairn.errors import ModelLoadError
from mlx_cairn.models.gguf_check import check_gguf
from mlx_cairn.models.llama import LlamaModel, ModelArgs
from mlx_cairn.models.loaded import LoadedModel, assemble
from mlx_cairn.models.weights import (
    cast_floats,
    dequantize_all,
    dtype_name,
    infer_bits,
    install_weights,
    resolve_dtype,
    weights_identity,
)

_GGUF_ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GROUP_SIZE = 32  # every GGUF block format MLX keeps quantized uses 32-value blocks


def _scalar(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    v = meta.get(key, default)
    if isinstance(v, mx.array):
        return v.item()
    return v


def _rename(key: str) -> str | None:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias|scales|biases)", key)
    if m:
        name = _LAYER_NAMES.get(m.group(2))
        return None if name is None else f"model.layers.{m.group(1)}.{name}.{m.group(3)}"
    m = re.fullmatch(r"(\w+)\.(weight|bias|scales|biases)", key)
    if m and m.group(1) in _TOP_NAMES:
        return f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def args_from_gguf(meta: dict[str, Any], weights: dict[str, mx.array]) -> ModelArgs:
    """Hyper-parameters from GGUF metadata; an unsupported architecture is named."""
    arch = meta.get("general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ModelLoadError(
            f"unsupported model architecture {arch!r} in GGUF; supported: {', '.join(sorted(_GGUF_ARCHS))}"
        )
    p = f"{arch}."
    heads = int(_scalar(meta, p + "attention.head_count"))
    hidden = int(_scalar(meta, p + "embedding_length"))
    if "token_embd.weight" not in weights:
        raise ModelLoadError("GGUF file has no token_embd.weight")
    vocab = _scalar(meta, p + "vocab_size") or weights["token_embd.weight"].shape[0]
    return ModelArgs(
        model_type=_GGUF_ARCHS[arch],
        hidden_size=hidden,
        num_hidden_layers=int(_scalar(meta, p + "block_count")),
        intermediate_size=int(_scalar(meta, p + "feed_forward_length")),
        num_attention_heads=heads,
        num_key_value_heads=int(_scalar(meta, p + "attention.head_count_kv", heads)),
        head_dim=int(_scalar(meta, p + "attention.key_length", hidden // heads)),
        vocab_size=int(vocab),
        rms_norm_eps=float(_scalar(meta, p + "attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_scalar(meta, p + "rope.freq_base", 10000.0)),
        rope_traditional=arch in ("llama", "mistral"),
        tie_word_embeddings="output.weight" not in weights,
        attention_bias=False,
        max_position_embeddings=int(_scalar(meta, p + "context_length", 4096)),
    )


def load_gguf(
    path: Path, *, dtype: str = "auto", keep_quantized: bool | None = None
) -> LoadedModel:
    """Load a ``.gguf`` file; unreadable or unsupported content is a :class:`ModelLoadError`."""
    check_gguf(path)  # MLX's reader crashes the process on a corrupt file instead of raising
    try:
        loaded = mx.load(str(path), return_metadata=True)
    except (OSError, ValueError, RuntimeError) as e:
        raise ModelLoadError(f"cannot read GGUF {path.name}: {e}") from None
    raw: dict[str, mx.array] = loaded[0]  # type: ignore[index,assignment]
    meta: dict[str, Any] = loaded[1]  # type: ignore[index,assignment]
    args = args_from_gguf(meta, raw)
    rope_factors = raw.get("rope_freqs.weight")
    weights = {}
    for k, v in raw.items():
        name = _rename(k)
        if name is not None:
            weights[name] = v

    floats = [v.dtype for k, v in weights.items() if k.endswith("norm.weight")]
    compute, dequant = resolve_dtype(dtype, floats[0] if floats else None)
    if keep_quantized is not None:
        dequant = not keep_quantized

    def spec(base: str) -> tuple[int, int] | None:
        scales = weights.get(f"{base}.scales")
        if scales is None:
            return None
        return _GROUP_SIZE, infer_bits(weights[f"{base}.weight"], scales, _GROUP_SIZE)

    quantized = any(k.endswith(".scales") for k in weights)
    tag = dtype_name(compute) + ("+q" if quantized and not dequant else "")
    if quantized and dequant:
        weights = dequantize_all(weights, spec, compute)
    weights = cast_floats(weights, compute)
    model = LlamaModel(args)
    install_weights(model, weights, spec if quantized and not dequant else None)
    if rope_factors is not None:
        # Llama 3.1 GGUFs store the long-context scaling as per-frequency divisors.
        d = args.head_dim or 0
        freqs = args.rope_theta ** (mx.arange(0, d, 2, dtype=mx.float32) / d) * rope_factors.astype(
            mx.float32
        )
        for layer in model.model.layers:
            layer.self_attn.rope.set_freqs(freqs)
        args.extra["rope_freqs_from_gguf"] = True

    tokenizer = tokenizer_from_gguf(meta)
    eos = set()
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        v = _scalar(meta, f"tokenizer.ggml.{key}")
        if v is not None:
            eos.add(int(v))
    template = meta.get("tokenizer.chat_template")
    name = path.name.removesuffix(".gguf")
    return assemble(
        name=name,
        model=model,
        tokenizer=tokenizer,
        template_source=template if isinstance(template, str) else CHATML,
        eos_token_ids=eos,
        context_length=args.max_position_embeddings,
        identity=f"{name}@{weights_identity([path], tag)}:{tag}",
        path=str(path),
        source_format="gguf",
    )

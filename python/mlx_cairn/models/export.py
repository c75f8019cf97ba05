"""Write a loaded model as a Hugging Face style folder (dense, or MLX-quantized).

The folder loads back with :func:`mlx_cairn.models.load` and with ``mlx_lm``.
Weights from a GGUF Llama (interleaved RoPE rows) are permuted back to the HF
split-half order so the folder runs with the usual ``rope_traditional=False``.

Example::

    save_folder(tiny_model("qwen3"), "/tmp/tiny-q4", quantize=(32, 4))
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_cairn.backends.cpu.layout import dense_parameters, hf_parameters
from mlx_cairn.models.llama import LlamaModel
from mlx_cairn.models.loaded import LoadedModel
from mlx_cairn.models.zoo import ZooModel, build_model


def _unpermute(w: mx.array, n_heads: int) -> mx.array:
    """Interleaved (GGUF) RoPE row order -> HF split-half order, per head."""
    out_dim = w.shape[0]
    hd = out_dim // n_heads
    rest = w.shape[1:]
    return w.reshape(n_heads, hd // 2, 2, *rest).swapaxes(1, 2).reshape(out_dim, *rest)


def dense_hf_weights(model: LlamaModel) -> dict[str, mx.array]:
    """The model's (dense) parameters under HF names, in the HF RoPE layout."""
    args = model.args
    weights = hf_parameters(model)
    if args.extra.get("rope_freqs_from_gguf"):
        raise ValueError("this GGUF's per-frequency RoPE factors have no config.json equivalent")
    if any(k.endswith(".scales") for k in weights):
        raise ValueError("export a dequantized model (load it on CPU or with dtype='float32')")
    if args.rope_traditional:
        for k in list(weights):
            if ".self_attn.q_proj." in k:
                weights[k] = _unpermute(weights[k], args.num_attention_heads)
            elif ".self_attn.k_proj." in k:
                weights[k] = _unpermute(weights[k], args.num_key_value_heads or 0)
    return weights


def save_folder(
    lm: LoadedModel,
    path: str | Path,
    *,
    quantize: tuple[int, int] | None = None,
    dtype: mx.Dtype | None = None,
) -> Path:
    """Write config, weights, tokenizer, template and generation config to ``path``.

    ``quantize=(group_size, bits)`` writes MLX affine-quantized linear and
    embedding weights with a ``quantization`` entry in ``config.json``.
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model = lm.model
    if isinstance(model, ZooModel):
        _save_zoo(model, out, quantize=quantize, dtype=dtype, lm=lm)
        return out
    weights = dense_hf_weights(model)
    if dtype is not None:
        weights = {k: v.astype(dtype) for k, v in weights.items()}
    config = model.args.to_config()
    config["architectures"] = [
        {
            "llama": "LlamaForCausalLM",
            "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM",
        }[model.args.model_type]
    ]
    config["eos_token_id"] = sorted(lm.eos_token_ids)
    if lm.tokenizer.bos_token_id is not None:
        config["bos_token_id"] = lm.tokenizer.bos_token_id
    if quantize is not None:
        group_size, bits = quantize
        quantized: dict[str, mx.array] = {}
        for k, v in weights.items():
            is_matrix = k.endswith(".weight") and v.ndim == 2 and "norm" not in k
            if is_matrix and v.shape[-1] % group_size == 0:
                wq, scales, biases = mx.quantize(v, group_size=group_size, bits=bits)
                base = k[: -len(".weight")]
                quantized.update({k: wq, f"{base}.scales": scales, f"{base}.biases": biases})
            else:
                quantized[k] = v
        weights = quantized
        config["quantization"] = {"group_size": group_size, "bits": bits}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _save_tokenizer(lm, out)
    return out


def _save_zoo(
    model: ZooModel,
    out: Path,
    *,
    quantize: tuple[int, int] | None,
    dtype: mx.Dtype | None,
    lm: LoadedModel,
) -> None:
    """An mlx-lm model's folder, as ``mlx_lm.convert`` writes it (mlx-lm parameter names)."""
    from mlx_cairn.models.gguf import FreqsRoPE

    if any(isinstance(m, FreqsRoPE) for _, m in model.named_modules()):
        raise ValueError("this GGUF's per-frequency RoPE factors have no config.json equivalent")
    config = dict(model.config)
    config["eos_token_id"] = sorted(lm.eos_token_ids)
    weights = dense_parameters(model.inner)
    if dtype is not None:
        weights = {k: v.astype(dtype) for k, v in weights.items()}
    if quantize is not None:
        group_size, bits = quantize
        # Quantize a copy, as mlx-lm does: every module that can be and whose width fits.
        copy = build_model(config, dict(weights))
        nn.quantize(
            copy,
            group_size=group_size,
            bits=bits,
            class_predicate=lambda _, m: (
                hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0
            ),
        )
        flat: list[tuple[str, mx.array]] = tree_flatten(copy.parameters())  # type: ignore[assignment]
        weights = dict(flat)
        config["quantization"] = {"group_size": group_size, "bits": bits, "mode": "affine"}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _save_tokenizer(lm, out)


def _save_tokenizer(lm: LoadedModel, out: Path) -> None:
    tok = lm.tokenizer
    tok.save(out / "tokenizer.json")
    tok_config = {
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "pad_token": tok.pad_token,
        "unk_token": tok.unk_token,
        "add_bos_token": tok.add_bos,
        "chat_template": lm.template.source,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": lm.context_length,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    gen: dict[str, object] = {"eos_token_id": sorted(lm.eos_token_ids)}
    if tok.bos_token_id is not None:
        gen["bos_token_id"] = tok.bos_token_id
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))

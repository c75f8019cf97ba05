"""The Llama family and Qwen2/Qwen3 in one decoder implementation.

Covers Llama 2/3.x (incl. ``llama3`` RoPE scaling), SmolLM2, Mistral,
Qwen2/2.5 (q/k/v biases) and Qwen3 (q/k RMSNorm), with tied or separate
embeddings and both RoPE layouts (``rope_traditional`` is true for GGUF
Llama checkpoints, which store Q/K rows interleaved). Module names follow the
Hugging Face checkpoints, so safetensors load without renaming.

The forward pass follows the :mod:`mlx_cairn.models.base` contract::

    h = model(tokens, cache)              # tokens [B, L] -> [B, L, hidden]
    logits = model.logits(h[:, -1, :])    # [B, vocab] fp32
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_cairn.backends.cpu import kernels as cpu_kernels
from mlx_cairn.backends.cpu.attention import attention
from mlx_cairn.errors import ModelLoadError
from mlx_cairn.models.base import KVCache

#: ``model_type`` values this module implements.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


@dataclass
class ModelArgs:
    """Hyper-parameters read from a Hugging Face ``config.json``."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rope_traditional: bool = False
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int = 4096
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3"

    @property
    def qkv_bias(self) -> bool:
        # Qwen2 always has q/k/v biases; Llama only with attention_bias.
        return self.model_type == "qwen2" or self.attention_bias

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        """Build from a ``config.json`` dict; unknown architectures are an error."""
        mt = config.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            archs = config.get("architectures") or []
            named = f"{mt!r}" + (f" ({', '.join(map(str, archs))})" if archs else "")
            raise ModelLoadError(
                f"unsupported model architecture {named}; supported: "
                + ", ".join(sorted(SUPPORTED_MODEL_TYPES))
            )
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        kwargs = {k: v for k, v in config.items() if k in known}
        try:
            args = cls(**kwargs, extra={k: v for k, v in config.items() if k not in known})
        except TypeError as e:
            raise ModelLoadError(f"config.json is missing a required field: {e}") from None
        return args

    def to_config(self) -> dict[str, Any]:
        """The ``config.json`` dict that :meth:`from_config` reads back."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "extra"}
        out.pop("rope_traditional")  # HF checkpoints always use the split-half layout
        out.update(self.extra)
        return out


def _llama3_freqs(dims: int, base: float, scaling: dict[str, Any]) -> mx.array:
    """RoPE frequencies with Llama 3.1 long-context scaling (as in HF ``_compute_llama3_parameters``)."""
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    freqs = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    wavelens = 2 * math.pi * freqs
    freqs = mx.where(wavelens > low_wavelen, freqs * factor, freqs)
    is_medium = (wavelens > high_wavelen) & (wavelens < low_wavelen)
    smooth = (old_ctx / wavelens - low) / (high - low)
    smooth_freqs = freqs / ((1 - smooth) / factor + smooth)
    return mx.where(is_medium, smooth_freqs, freqs)


class RoPE(nn.Module):
    """Rotary embedding at per-row offsets (``offset`` is an int32 array [B])."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        assert args.head_dim is not None
        self.dims: int = args.head_dim
        self.traditional = args.rope_traditional
        self.base: float | None = args.rope_theta
        self.scale = 1.0
        self._freqs: mx.array | None = None
        rs = args.rope_scaling or {}
        kind = rs.get("rope_type", rs.get("type"))
        if kind == "llama3":
            self._freqs = _llama3_freqs(self.dims, args.rope_theta, rs)
            self.base = None
        elif kind == "linear":
            self.scale = 1.0 / rs["factor"]
        elif kind not in (None, "default"):
            raise ModelLoadError(f"unsupported rope_scaling type {kind!r}")

    def set_freqs(self, freqs: mx.array) -> None:
        """Use explicit per-pair RoPE periods (as ``mx.fast.rope``'s ``freqs``)."""
        self._freqs = freqs
        self.base = None
        self.scale = 1.0

    def __call__(self, x: mx.array, offset: mx.array) -> mx.array:
        return mx.fast.rope(
            x,
            self.dims,
            traditional=self.traditional,
            base=self.base,
            scale=self.scale,
            offset=offset,
            freqs=self._freqs,
        )


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = hd = args.head_dim
        assert self.n_kv_heads is not None and hd is not None
        self.scale = hd**-0.5
        dim, bias = args.hidden_size, args.qkv_bias
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=args.attention_bias)
        if args.qk_norm:
            self.q_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
            self.k_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.qk_norm = args.qk_norm
        self.rope = RoPE(args)

    def __call__(self, x: mx.array, cache: KVCache) -> mx.array:
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))  # [B, heads, L, hd]
        offsets = cache.offsets
        q = self.rope(q, offsets)
        k = self.rope(k, offsets)
        k_all, v_all, mask = cache.update_and_fetch(self.layer, k, v)
        out = attention(q, k_all, v_all, self.scale, mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        dim, hidden, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(cpu_kernels.swiglu(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(args, layer)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, cache: KVCache) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    """``model.*`` in HF checkpoints: embeddings, layers, final norm."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class LlamaModel(nn.Module):
    """A decoder-only causal LM over a :class:`~mlx_cairn.models.base.KVCache`."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = Backbone(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.num_layers = args.num_hidden_layers
        self.num_kv_heads: int = args.num_key_value_heads  # type: ignore[assignment]
        self.head_dim: int = args.head_dim  # type: ignore[assignment]
        self.vocab_size = args.vocab_size

    def __call__(self, tokens: mx.array, cache: KVCache) -> mx.array:
        h = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            h = layer(h, cache)
        return h

    def logits(self, hidden: mx.array) -> mx.array:
        h = self.model.norm(hidden)
        if "head" in self:  # a re-laid head (models.cpu_layout)
            out = self.head(h)
        elif self.args.tie_word_embeddings:
            out = self.model.embed_tokens.as_linear(h)
        else:
            out = self.lm_head(h)
        return out.astype(mx.float32)

    @property
    def dtype(self) -> mx.Dtype:
        return self.model.norm.weight.dtype

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Drop checkpoint entries this implementation does not use."""
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
            weights.pop("lm_head.scales", None)
            weights.pop("lm_head.biases", None)
        return weights

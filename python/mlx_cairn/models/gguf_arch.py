"""What a GGUF file means in Hugging Face terms: ``config.json`` and tensor names.

Names come from the ``gguf`` package's own tables (``get_tensor_name_map``),
which map many checkpoint spellings to each GGUF tensor. We ask them the
other way round, the way transformers' GGUF loader does with a model's state
dict: for each module name a Hugging Face checkpoint of these families uses
(:data:`HF_LAYER_MODULES`), gguf-py says which GGUF tensor it is::

    "model.layers.3.mlp.up_proj"  --gguf-py-->  "blk.3.ffn_up"
    reverse:  "blk.3.ffn_up.weight"  ->  "model.layers.3.mlp.up_proj.weight"

The first module that claims a GGUF tensor keeps it (Phi-3 puts its fused
``gate_up_proj`` first, :attr:`ArchSpec.first`). A tensor no module claims is
an error, not a silent drop.

What llama.cpp changes on conversion and we undo (:func:`to_hf`):

- Llama-family Q/K rows are permuted into interleaved RoPE order
  (``qk_order="hf"`` restores the split-half order; ``"gguf"`` keeps them and
  sets ``rope_traditional``, which our Llama model and mlx-lm's read);
- Gemma's RMSNorm weights are stored as ``1 + w``;
- MoE experts are stacked into one ``[experts, out, in]`` tensor per
  projection; HF names one matrix per expert, mlx-lm keeps the stack
  (``mlp.switch_mlp.*``, as in MLX-quantized checkpoints), and so do we.

Metadata llama.cpp does not store but hard-codes per architecture (Gemma 3's
sliding-window pattern and local RoPE base, Qwen3-MoE's top-k normalisation)
is filled in here with the same values llama.cpp uses.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import gguf
import numpy as np
from gguf.constants import MODEL_ARCH_NAMES

from mlx_cairn.errors import ModelLoadError
from mlx_cairn.models.gguf_check import TensorInfo

#: Top-level HF names of the decoder-only families below.
HF_TOP_MODULES = ("model.embed_tokens", "model.norm", "lm_head")
#: Per-layer HF module names (under ``model.layers.N.``), first claim wins.
HF_LAYER_MODULES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.qkv_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "mlp.gate_up_proj",
    "mlp.gate",
    "mlp.experts.gate_proj",
    "mlp.experts.up_proj",
    "mlp.experts.down_proj",
    "mlp.shared_expert.gate_proj",
    "mlp.shared_expert.up_proj",
    "mlp.shared_expert.down_proj",
    "mlp.shared_expert_gate",
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)
#: GGUF tensors that are not weights of a module: RoPE tables (read into the config or
#: returned apart) and llama.cpp's cached inverse frequencies.
NOT_MODULES = re.compile(
    r"rope_freqs\.weight|rope_factors_(long|short)\.weight|blk\.\d+\.attn_rot_embd\..*"
)

Meta = Mapping[str, Any]


@dataclass(frozen=True)
class ArchSpec:
    """How one GGUF ``general.architecture`` maps to a Hugging Face model."""

    model_type: str
    hf_class: str
    #: llama.cpp permuted Q/K rows into interleaved RoPE order (LLAMA_ROPE_TYPE_NORM).
    permuted_qk: bool = False
    #: Added to every ``*norm.weight`` by llama.cpp's converter.
    norm_shift: float = 0.0
    #: Modules tried before :data:`HF_LAYER_MODULES` (their claim wins).
    first: tuple[str, ...] = ()
    #: Architecture-specific config entries: ``extra(meta, config, small_tensor)``.
    extra: Callable[[Meta, dict[str, Any], Callable[[str], np.ndarray | None]], None] | None = (
        field(default=None)
    )


def _qwen3_moe(meta: Meta, cfg: dict[str, Any], small: Callable[[str], Any]) -> None:
    p = "qwen3moe."
    cfg["num_experts"] = _int(_need(meta, p + "expert_count"))
    cfg["num_experts_per_tok"] = _int(_need(meta, p + "expert_used_count"))
    cfg["moe_intermediate_size"] = _int(_need(meta, p + "expert_feed_forward_length"))
    cfg.setdefault("intermediate_size", cfg["moe_intermediate_size"])
    # llama.cpp's qwen3moe graph always renormalises the top-k weights.
    cfg.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])


def _gemma3(meta: Meta, cfg: dict[str, Any], small: Callable[[str], Any]) -> None:
    p = "gemma3."
    n = cfg["num_hidden_layers"]
    # llama.cpp (llama-model.cpp, LLM_ARCH_GEMMA3): pattern 6, local RoPE base 10k, and the
    # query scale 1/sqrt(head_dim) except for the 62-layer 27B (1/sqrt(hidden/heads)).
    pattern = _int(meta.get(p + "attention.sliding_window_pattern", 6))
    scalar = cfg["hidden_size"] // cfg["num_attention_heads"] if n == 62 else cfg["head_dim"]
    cfg.update(
        rope_local_base_freq=float(meta.get(p + "rope.freq_base_swa", 10000.0)),
        # mlx-lm's gemma3_text spells the global base this way.
        rope_global_base_freq=cfg["rope_theta"],
        sliding_window_pattern=pattern,
        layer_types=[
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)
        ],
        query_pre_attn_scalar=scalar,
        hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=meta.get(p + "final_logit_softcapping"),
        attn_logit_softcapping=meta.get(p + "attn_logit_softcapping"),
    )


def _phi3(meta: Meta, cfg: dict[str, Any], small: Callable[[str], Any]) -> None:
    orig = meta.get("phi3.rope.scaling.original_context_length")
    cfg["original_max_position_embeddings"] = _int(orig) if orig else cfg["max_position_embeddings"]
    long, short = small("rope_factors_long.weight"), small("rope_factors_short.weight")
    if long is not None and short is not None:
        cfg["rope_scaling"] = {
            "type": "longrope",
            "long_factor": [float(x) for x in long],
            "short_factor": [float(x) for x in short],
        }


#: GGUF ``general.architecture`` -> how it maps; at least what issue 14 names.
ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", "LlamaForCausalLM", permuted_qk=True),
    "qwen2": ArchSpec("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ArchSpec("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": ArchSpec("qwen3_moe", "Qwen3MoeForCausalLM", extra=_qwen3_moe),
    "gemma3": ArchSpec("gemma3_text", "Gemma3ForCausalLM", norm_shift=1.0, extra=_gemma3),
    # HF Phi-3 fuses gate and up; gguf-py lists both spellings under ffn_up.
    "phi3": ArchSpec("phi3", "Phi3ForCausalLM", first=("mlp.gate_up_proj",), extra=_phi3),
}


def arch_spec(meta: Meta) -> tuple[str, ArchSpec]:
    """The file's architecture and its spec; an unsupported one is named with the list."""
    arch = meta.get("general.architecture")
    if arch not in ARCHS:
        raise ModelLoadError(
            f"unsupported model architecture {arch!r} in GGUF; supported: {', '.join(sorted(ARCHS))}"
        )
    return arch, ARCHS[arch]


def _need(meta: Meta, key: str) -> Any:
    if key not in meta:
        raise ModelLoadError(f"GGUF metadata lacks {key}")
    return meta[key]


def _int(v: Any) -> int:
    """An int from a scalar or a per-layer array whose entries agree."""
    if isinstance(v, np.ndarray):
        values = set(v.tolist())
        if len(values) != 1:
            raise ModelLoadError(f"per-layer values {sorted(values)} are not supported")
        v = values.pop()
    return int(v)


def _token_id(meta: Meta, key: str) -> int | None:
    v = meta.get(f"tokenizer.ggml.{key}")
    return None if v is None else int(v)


def config_from_gguf(
    meta: Meta,
    tensors: Mapping[str, TensorInfo],
    small: Callable[[str], np.ndarray | None],
    *,
    qk_order: str = "hf",
) -> dict[str, Any]:
    """A Hugging Face ``config.json`` dict (``model_type`` as HF / mlx-lm name it).

    ``small(name)`` reads a small tensor (RoPE factors) as float32, or None.
    """
    arch, spec = arch_spec(meta)
    p = f"{arch}."
    hidden = _int(_need(meta, p + "embedding_length"))
    heads = _int(_need(meta, p + "attention.head_count"))
    head_dim = _int(meta.get(p + "attention.key_length", hidden // heads))
    emb = tensors.get("token_embd.weight")
    vocab = meta.get(p + "vocab_size") or (
        emb.shape[0] if emb is not None else len(meta.get("tokenizer.ggml.tokens") or [])
    )
    cfg: dict[str, Any] = {
        "architectures": [spec.hf_class],
        "model_type": spec.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": _int(_need(meta, p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": _int(meta.get(p + "attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "vocab_size": int(vocab),
        "rms_norm_eps": float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta.get(p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": _int(meta.get(p + "context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensors,
        # HF Llama's attention_bias covers o_proj too; Qwen2's q/k/v biases are implied by its type.
        "attention_bias": "blk.0.attn_output.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
        "rope_scaling": None,
    }
    if p + "feed_forward_length" in meta:
        cfg["intermediate_size"] = _int(meta[p + "feed_forward_length"])
    rope_dims = meta.get(p + "rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        cfg["partial_rotary_factor"] = int(rope_dims) / head_dim
    if p + "attention.sliding_window" in meta:
        cfg["sliding_window"] = _int(meta[p + "attention.sliding_window"])
    kind = meta.get(p + "rope.scaling.type")
    factor = meta.get(p + "rope.scaling.factor")
    if kind == "linear" and factor:
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    elif kind == "yarn" and factor:
        orig = meta.get(p + "rope.scaling.original_context_length")
        cfg["rope_scaling"] = {"rope_type": "yarn", "factor": float(factor)}
        if orig:
            cfg["rope_scaling"]["original_max_position_embeddings"] = int(orig)
    for hf_key, gguf_key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("pad_token_id", "padding_token_id"),
    ):
        tid = _token_id(meta, gguf_key)
        if tid is not None:
            cfg[hf_key] = tid
    if spec.permuted_qk and qk_order == "gguf":
        cfg["rope_traditional"] = True
    if spec.extra is not None:
        spec.extra(meta, cfg, small)
    if "intermediate_size" not in cfg:
        raise ModelLoadError(f"GGUF metadata lacks {p}feed_forward_length")
    return cfg


def hf_name_map(arch: str, n_layers: int) -> dict[str, str]:
    """GGUF tensor base name -> HF module name (``blk.0.attn_q`` -> ``model.layers.0.self_attn.q_proj``)."""
    spec = ARCHS[arch]
    enum = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    tmap = gguf.get_tensor_name_map(enum, n_layers)
    out: dict[str, str] = {}

    def claim(hf: str) -> None:
        name = tmap.get_name(hf)
        if name is not None and name not in out:
            out[name] = hf

    for hf in HF_TOP_MODULES:
        claim(hf)
    modules = (*spec.first, *HF_LAYER_MODULES)
    for i in range(n_layers):
        for m in modules:
            claim(f"model.layers.{i}.{m}")
    return out


def hf_name(names: Mapping[str, str], gguf_name: str) -> str:
    """HF parameter name of a GGUF tensor name, e.g. ``blk.0.attn_q.weight``."""
    base, _, suffix = gguf_name.rpartition(".")
    hf = names.get(base)
    if hf is None or suffix not in ("weight", "bias"):
        raise ModelLoadError(
            f"GGUF tensor {gguf_name} has no Hugging Face name in this architecture"
        )
    return f"{hf}.{suffix}"


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE rows -> HF split-half rows).

    Per head, llama.cpp writes rows ``0, d/2, 1, d/2+1, ...`` of the HF head::

        HF    [h][half][i]   --permute-->   GGUF [h][i][half]
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def to_hf(
    spec: ArchSpec,
    config: Mapping[str, Any],
    name: str,
    arrays: dict[str, Any],
    *,
    qk_order: str,
) -> tuple[str, dict[str, Any]]:
    """Undo llama.cpp's conversion of one tensor: (module name, {"weight"/"bias"/"scales"/...: array}).

    ``name`` is the tensor's HF parameter name; ``arrays`` is its dense
    ``{"weight": w}`` or affine ``{"weight", "scales", "biases"}`` form
    (numpy or mx arrays, rows on axis 0); a bias comes back as ``{"bias": b}``.
    """
    base, _, suffix = name.rpartition(".")
    if suffix == "bias":
        arrays = {"bias": arrays["weight"]}
    if (
        spec.permuted_qk
        and qk_order == "hf"
        and base.endswith(("self_attn.q_proj", "self_attn.k_proj"))
    ):
        heads = (
            config["num_attention_heads"]
            if base.endswith("q_proj")
            else config["num_key_value_heads"]
        )
        arrays = {k: _rows(v, partial(unpermute_qk, n_heads=heads)) for k, v in arrays.items()}
    if spec.norm_shift and suffix == "weight" and base.endswith("norm") and "scales" not in arrays:
        arrays = {"weight": arrays["weight"] - spec.norm_shift}
    if re.search(r"\.mlp\.experts\.\w+$", base) and arrays[next(iter(arrays))].ndim == 3:
        # Stacked experts keep their [experts, out, in] stack under mlx-lm's SwitchGLU name,
        # the layout of MLX-quantized checkpoints: mlx-lm's MoE classes load it as it is
        # (their sanitize re-stacks per-expert HF matrices, but only dense ".weight"s).
        base = base.replace(".mlp.experts.", ".mlp.switch_mlp.")
    return base, arrays


def _rows(a: Any, f: Callable[[np.ndarray], np.ndarray]) -> Any:
    """Apply a numpy row transform to a numpy or mx array."""
    if isinstance(a, np.ndarray):
        return f(a)
    import mlx.core as mx

    idx = f(np.arange(a.shape[0]))
    return mx.take(a, mx.array(idx), axis=0)

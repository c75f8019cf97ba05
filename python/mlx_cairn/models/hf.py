"""Load a Hugging Face style folder (dense or MLX-quantized safetensors).

Reads ``config.json``, ``model.safetensors`` or the shards named by
``model.safetensors.index.json``, ``tokenizer.json``, ``tokenizer_config.json``
/ ``chat_template.jinja`` / ``chat_template.json``, and
``generation_config.json``. MLX-quantized folders (mlx-community style) carry
``"quantization": {"group_size": G, "bits": B}`` in ``config.json``, possibly
with per-layer overrides keyed by module path.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_cairn.chat.builtin_templates import CHATML
from mlx_cairn.chat.tokenizer import Tokenizer
from mlx_cairn.errors import ModelLoadError
from mlx_cairn.models import zoo
from mlx_cairn.models.llama import LlamaModel, ModelArgs
from mlx_cairn.models.loaded import LoadedModel, assemble
from mlx_cairn.models.weights import (
    QuantSpec,
    cast_floats,
    dequantize_all,
    dtype_name,
    install_weights,
    resolve_dtype,
    weights_identity,
)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path.name}: {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path.name} is not a JSON object")
    return data


def _token_str(v: Any) -> str | None:
    """tokenizer_config token entries are strings or ``{"content": ...}`` dicts."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _ids(v: Any) -> set[int]:
    if isinstance(v, int):
        return {v}
    if isinstance(v, list):
        return {int(x) for x in v if isinstance(x, int)}
    return set()


def quant_spec(config: dict[str, Any]) -> QuantSpec | None:
    """Per-layer (group_size, bits) from an MLX ``quantization`` config, or None if dense."""
    q = config.get("quantization") or config.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method not in (None, "mlx") or "bits" not in q:
        raise ModelLoadError(
            f"unsupported quantization {method or q!r}; only MLX affine quantization loads"
        )
    mode = q.get("mode", "affine")
    if mode != "affine":
        raise ModelLoadError(f"unsupported MLX quantization mode {mode!r}")
    default = (int(q.get("group_size", 64)), int(q["bits"]))

    def spec(path: str) -> tuple[int, int] | None:
        override = q.get(path)
        if override is False:
            return None
        if isinstance(override, dict):
            return int(override.get("group_size", default[0])), int(
                override.get("bits", default[1])
            )
        return default

    return spec


#: model_types HF folders still load into the hand-written models/llama.py: none. With the
#: same CPU layout and prefill attention, mlx-lm's llama measured as fast or faster
#: (bench/RESULTS.md, "llama.py vs mlx-lm's llama"); only GGUF files still use llama.py.
LLAMA_PATH_TYPES: frozenset[str] = frozenset()

#: Context length when a config names none.
DEFAULT_CONTEXT = 4096


def context_length(config: dict[str, Any]) -> int:
    """The model's context length from its config: a multimodal wrapper's text_config
    first (its language model's, which mlx-lm builds from it; a top-level figure in such
    a wrapper may be another tower's or a leftover)."""
    for c in (config.get("text_config") or {}, config):
        for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions"):
            v = c.get(key)
            if isinstance(v, int) and v > 0:
                return v
    return DEFAULT_CONTEXT


def _mlx_or_dense(config: dict[str, Any]) -> bool:
    """Whether the weights are dense or MLX affine (what models/llama.py reads; the rest
    of mlx-lm's quantization formats load through models/zoo.py)."""
    q = config.get("quantization") or config.get("quantization_config")
    return not q or (q.get("quant_method") in (None, "mlx") and q.get("mode", "affine") == "affine")


def _llama_path(config: dict[str, Any]) -> bool:
    """Whether models/llama.py runs this config exactly; anything it lacks (other RoPE
    scalings, sliding-window layers, other quantization formats) goes to mlx-lm."""
    if config.get("model_type") not in LLAMA_PATH_TYPES or not _mlx_or_dense(config):
        return False
    rs = config.get("rope_scaling") or {}
    if rs.get("rope_type", rs.get("type")) not in (None, "default", "llama3", "linear"):
        return False
    if "sliding_attention" in (config.get("layer_types") or []):
        return False
    return not config.get("use_sliding_window")


def _quantized_config(config: dict[str, Any]) -> bool:
    return bool(config.get("quantization") or config.get("quantization_config"))


def _chat_template(folder: Path, tok_config: dict[str, Any]) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    tpl = tok_config.get("chat_template")
    if tpl is None and (folder / "chat_template.json").is_file():
        tpl = _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(tpl, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default") or next(iter(named.values()), None)
    return tpl if isinstance(tpl, str) else None


def _template_writes_bos(tok: Tokenizer) -> bool:
    """Whether the tokenizer's post-processor prepends BOS (Llama 2/3 style)."""
    if tok.bos_token_id is None:
        return False
    with_special = tok.hf.encode("a", add_special_tokens=True).ids
    return bool(with_special) and with_special[0] == tok.bos_token_id


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shard_names = sorted(set(_read_json(index).get("weight_map", {}).values()))
        files = [folder / n for n in shard_names]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights")
    return files


def _load_llama(
    folder: Path, config: dict[str, Any], files: list[Path], dtype: str, keep_quantized: bool | None
) -> tuple[LlamaModel, str]:
    """The hand-written Llama-family path (models/llama.py)."""
    args = ModelArgs.from_config(config)
    spec = quant_spec(config)
    weights: dict[str, mx.array] = {}
    for f in files:
        try:
            loaded = mx.load(str(f))
        except (OSError, ValueError, RuntimeError) as e:
            raise ModelLoadError(f"cannot read {f.name}: {e}") from None
        if not isinstance(loaded, dict):
            raise ModelLoadError(f"{f.name} is not a safetensors file")
        weights.update(loaded)

    floats = [v.dtype for k, v in weights.items() if k.endswith("norm.weight")]
    compute, dequant = resolve_dtype(dtype, floats[0] if floats else None)
    if keep_quantized is not None:
        dequant = not keep_quantized
    tag = dtype_name(compute) + ("+q" if spec is not None and not dequant else "")
    if spec is not None and dequant:
        weights = dequantize_all(weights, spec, compute)
        spec = None
    weights = cast_floats(weights, compute)
    model = LlamaModel(args)
    install_weights(model, weights, spec)
    return model, tag


def _load_zoo(
    folder: Path,
    dtype: str,
    keep_quantized: bool | None,
    shard: Callable[[Any], object] | None = None,
) -> tuple[zoo.ZooModel, dict[str, Any], str]:
    """Any attention architecture mlx-lm implements (models/zoo.py); ``shard`` splits
    the lazily loaded model before anything is evaluated."""
    model, config = zoo.load_folder(folder)
    if shard is not None:
        shard(model)
    compute, dequant = resolve_dtype(dtype, zoo.checkpoint_dtype(model))
    if keep_quantized is not None:
        dequant = not keep_quantized
    quantized = zoo.is_quantized(model)
    tag = dtype_name(compute) + ("+q" if quantized and not dequant else "")
    return zoo.finish(model, config, compute=compute, dequant=dequant), config, tag


def load_hf_folder(
    folder: Path,
    *,
    dtype: str = "auto",
    keep_quantized: bool | None = None,
    shard: Callable[[Any], object] | None = None,
) -> LoadedModel:
    """Load ``folder``; a missing or malformed file is a :class:`ModelLoadError`.

    Llama-family folders (:data:`~mlx_cairn.models.llama.SUPPORTED_MODEL_TYPES`)
    run the hand-written models/llama.py; every other attention architecture
    runs mlx-lm's own class (models/zoo.py); anything else is refused by name.
    """
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{folder} has no config.json")
    config = raw_config = _read_json(config_path)
    files = _safetensors_files(folder)
    model: Any
    vision = None
    from mlx_cairn.models.vision import load_vision_model, vision_model_type

    if shard is not None:  # one rank's shard: mlx-lm's class, split before evaluation
        if vision_model_type(config) is not None:
            raise ModelLoadError(f"{folder.name}: vision models cannot run across ranks yet")
        model, config, tag = _load_zoo(folder, dtype, keep_quantized, shard)
        context = context_length(config)
    elif vision_model_type(config) is not None:
        model, vision, config, tag = load_vision_model(folder, dtype, keep_quantized)
        context = context_length(config)
    elif _llama_path(config):
        model, tag = _load_llama(folder, config, files, dtype, keep_quantized)
        context = int(model.args.max_position_embeddings)
    else:
        model, config, tag = _load_zoo(folder, dtype, keep_quantized)
        context = context_length(config)

    tok_file = folder / "tokenizer.json"
    if not tok_file.is_file():
        raise ModelLoadError(f"{folder} has no tokenizer.json")
    tok_config = (
        _read_json(folder / "tokenizer_config.json")
        if (folder / "tokenizer_config.json").is_file()
        else {}
    )
    try:
        tokenizer = Tokenizer.from_file(
            tok_file,
            bos_token=_token_str(tok_config.get("bos_token")),
            eos_token=_token_str(tok_config.get("eos_token")),
            pad_token=_token_str(tok_config.get("pad_token")),
            unk_token=_token_str(tok_config.get("unk_token")),
        )
    except Exception as e:  # tokenizers raises plain Exception on bad JSON
        raise ModelLoadError(f"cannot read tokenizer.json: {e}") from None
    add_bos = tok_config.get("add_bos_token")
    tokenizer.add_bos = (
        bool(add_bos) if isinstance(add_bos, bool) else _template_writes_bos(tokenizer)
    )

    eos = _ids(raw_config.get("eos_token_id")) | _ids(config.get("eos_token_id"))
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():
        eos |= _ids(_read_json(gen_path).get("eos_token_id"))

    template = _chat_template(folder, tok_config)
    files_for_id = [config_path, *files]
    lm = assemble(
        name=folder.name,
        model=model,
        tokenizer=tokenizer,
        template_source=template or CHATML,
        eos_token_ids=eos,
        context_length=context,
        identity=f"{folder.name}@{weights_identity(files_for_id, tag)}:{tag}",
        path=str(folder),
        source_format="mlx-quantized" if "+q" in tag or _quantized_config(config) else "hf",
    )
    if vision is not None:
        lm.vision = vision
        lm.takes_images = True
    return lm

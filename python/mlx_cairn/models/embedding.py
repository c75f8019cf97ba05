"""Embedding models: which folders are one, loading them, and one pooled forward pass.

Two families, each run by the library that keeps it:

- encoders (BERT, XLM-R / bge-m3, ModernBERT) through ``mlx-embeddings``'
  architecture classes and its loader (``mlx_embeddings.utils.load_model``);
- decoders with a pooling head (Qwen3-Embedding, gte-Qwen2 style) through
  mlx-lm's architecture classes: the backbone (``Model.model``) only, no LM head.

A folder is an embedding model when its ``config.json`` names an encoder
``model_type``, when its ``architectures`` are bare backbones (``Qwen3Model``,
not ``Qwen3ForCausalLM``), or when it carries sentence-transformers files
(``modules.json`` with a Pooling module). ``1_Pooling/config.json`` says the
pooling (cls / mean / max / last token) and ``sentence_bert_config.json`` the
longest input; without them encoders pool the mean and decoders the last token.

Vectors always come back L2-normalized, as OpenAI's and Ollama's do (a
cosine is then a dot product). Example::

    em = load_embedding_model(Path("bge-small-en"))
    ids = em.tokenize(["hello", "world"], truncate=False)
    vecs = em.embed(ids)            # numpy float32 [2, em.dimensions], unit length
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from mlx_cairn.errors import ContextLengthExceeded, InvalidRequest, ModelLoadError
from mlx_cairn.models import zoo
from mlx_cairn.models.weights import dtype_name, resolve_dtype, weights_identity

#: Encoder ``model_type`` -> the ``mlx_embeddings.models`` module that runs it.
ENCODER_TYPES: dict[str, str] = {
    "bert": "bert",
    "xlm-roberta": "xlm_roberta",
    "xlm_roberta": "xlm_roberta",
    "modernbert": "modernbert",
}
#: Encoder families mlx-embeddings does not implement (refused by name at load).
UNSUPPORTED_ENCODERS = frozenset(
    {"nomic_bert", "roberta", "distilbert", "mpnet", "new", "deberta-v2", "electra", "t5"}
)
#: sentence-transformers ``1_Pooling/config.json`` switches -> our pooling modes.
_ST_POOLING = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_lasttoken": "last",
}
#: Pooling modes :func:`pool` computes.
POOLING_MODES = ("cls", "mean", "max", "last")
#: sentence-transformers modules a folder may list: the ones that change vectors
#: and are not listed here (Dense projections, LayerNorm...) are refused at load.
_ST_MODULES = frozenset({"Transformer", "Pooling", "Normalize"})
#: Smallest ``dimensions`` a Matryoshka model may be cut to when its config
#: names no sizes (Qwen3-Embedding documents 32 as its floor).
MATRYOSHKA_FLOOR = 32


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path.name}: {e}") from None


def _model_type(config: dict[str, Any]) -> str:
    return str(config.get("model_type") or "")


def _st_modules(folder: Path) -> list[str] | None:
    """The sentence-transformers module types of ``modules.json`` (None: no such file)."""
    path = folder / "modules.json"
    if not path.is_file():
        return None
    entries = _read_json(path)
    if not isinstance(entries, list):
        raise ModelLoadError("modules.json is not a list")
    return [str(e.get("type", "")).rsplit(".", 1)[-1] for e in entries if isinstance(e, dict)]


def _bare_backbone(config: dict[str, Any]) -> bool:
    """``architectures`` names only backbones (``Qwen2Model``), no task head."""
    archs = config.get("architectures") or []
    return bool(archs) and all(isinstance(a, str) and a.endswith("Model") for a in archs)


def embedding_family(folder: Path) -> str | None:
    """``"encoder"`` / ``"decoder"`` for an embedding model folder, None for anything else.

    >>> embedding_family(Path("/nonexistent"))  # no config.json: not ours to judge
    """
    path = folder / "config.json"
    if not path.is_file():
        return None
    config = _read_json(path)
    if not isinstance(config, dict):
        return None
    mt = _model_type(config)
    if mt in ENCODER_TYPES or mt in UNSUPPORTED_ENCODERS:
        return "encoder"
    modules = _st_modules(folder)
    if (modules is not None and "Pooling" in modules) or _bare_backbone(config):
        return "decoder"
    return None


def source_kind(source: str | None) -> str | None:
    """``"embedding"`` / ``"chat"`` for a served model's source without loading it;
    None when that needs a download (a hub name not resolved yet)."""
    if source is None:
        return "chat"  # the embedded default model
    path = Path(source).expanduser()
    if path.is_dir():
        return "embedding" if embedding_family(path) else "chat"
    if path.is_file():
        return "chat"  # GGUF files load as chat models
    return None


def model_kind(loaded: Any, source: str | None) -> str | None:
    """``"embedding"`` / ``"chat"`` for a served model: from the loaded object when
    there is one, else from its source (:func:`source_kind`)."""
    if loaded is not None:
        return "embedding" if getattr(loaded, "kind", None) == "embedding" else "chat"
    return source_kind(source)


def not_a_chat_model(name: str) -> InvalidRequest:
    """The 400 for an embedding model asked for chat, messages or completions."""
    return InvalidRequest(
        f"model {name!r} is an embedding model: it answers POST /v1/embeddings (and "
        "Ollama's /api/embed), not chat, messages or completions; name a chat model",
        param="model",
    )


def not_an_embedding_model(name: str) -> InvalidRequest:
    """The 400 for a chat model asked for embeddings."""
    return InvalidRequest(
        f"model {name!r} is a chat model, not an embedding model; serve an embedding "
        "model (BERT, XLM-RoBERTa / bge-m3, ModernBERT, or a Qwen3-Embedding style "
        "folder) and name it here",
        param="model",
    )


# ------------------------------------------------------------------ tokenizing


class EmbeddingTokenizer:
    """``tokenizer.json`` as sentence-transformers applies it: the post-processor's
    specials ([CLS]/[SEP], a closing EOS) around each text, truncation inside them.

    Request text is data: a special token's spelling in it is read as plain text.
    """

    def __init__(self, hf: HFTokenizer) -> None:
        self.hf = hf
        self._plain = HFTokenizer.from_str(hf.to_str())
        self._plain.encode_special_tokens = True
        self.specials = int(hf.num_special_tokens_to_add(False))
        self.vocab_size = int(hf.get_vocab_size(with_added_tokens=True))

    def encode(self, texts: list[str], *, max_length: int, truncate: bool) -> list[list[int]]:
        """Token ids of each text, at most ``max_length`` each (cut at the end when
        ``truncate``, else ContextLengthExceeded). ``encode_batch`` releases the GIL."""
        room = max(1, max_length - self.specials)
        out: list[list[int]] = []
        for enc in self._plain.encode_batch(texts, add_special_tokens=False):
            if len(enc.ids) > room:
                if not truncate:
                    raise ContextLengthExceeded(
                        prompt_tokens=len(enc.ids) + self.specials,
                        limit=max_length,
                        prompt_param="input",
                    )
                enc.truncate(room)
            out.append(list(self._plain.post_process(enc).ids))
        return out


# ------------------------------------------------------------------ the model


@dataclass(frozen=True, slots=True)
class Matryoshka:
    """Which ``dimensions`` a model's vectors may be cut to (then normalized again)."""

    smallest: int
    #: The sizes it was trained at (None: any size from ``smallest`` up).
    sizes: tuple[int, ...] | None = None

    def allows(self, n: int, full: int) -> bool:
        if self.sizes is not None:
            return n in self.sizes or n == full
        return self.smallest <= n <= full


@dataclass
class EmbeddingModel:
    """A loaded embedding model: tokenizer, forward pass and pooling (see the module doc)."""

    name: str
    family: str  # "encoder" | "decoder"
    model_type: str
    #: The mlx module holding every weight (the decoder's backbone, or the encoder).
    model: nn.Module
    tokenizer: EmbeddingTokenizer
    pooling: str
    #: Width of a full vector.
    dimensions: int
    #: Longest input, in tokens (specials included).
    max_length: int
    pad_id: int
    identity: str
    path: str = ""
    matryoshka: Matryoshka | None = None
    #: Decoders only: attention over the whole input (``is_causal: false``).
    bidirectional: bool = False
    #: Parameters, for sizing a forward pass (FLOPs per token ~ 2 * parameters).
    num_parameters: int = 0
    #: Rows of the input embedding table: token ids given as input must be below it.
    vocab_size: int = 0
    extra: dict[str, object] = field(default_factory=dict)

    kind = "embedding"

    @property
    def context_length(self) -> int:
        """The longest input (the model listings' ``context_length``)."""
        return self.max_length

    def tokenize(self, texts: list[str], *, truncate: bool) -> list[list[int]]:
        """Token ids for each text (see :meth:`EmbeddingTokenizer.encode`)."""
        return self.tokenizer.encode(texts, max_length=self.max_length, truncate=truncate)

    def embed(self, batch: list[list[int]]) -> np.ndarray:
        """Unit-length vectors [len(batch), dimensions] of token-id sequences (one forward)."""
        lengths = [len(s) for s in batch]
        width = max(lengths)
        ids = np.full((len(batch), width), self.pad_id, dtype=np.int32)
        mask = np.zeros((len(batch), width), dtype=np.float32)
        for i, s in enumerate(batch):  # right padding: real tokens never see it (masks, causality)
            ids[i, : len(s)] = s
            mask[i, : len(s)] = 1.0
        hidden = self._hidden(mx.array(ids), mx.array(mask))
        vecs = normalize(pool(hidden.astype(mx.float32), mx.array(mask), self.pooling))
        mx.eval(vecs)
        return np.array(vecs, dtype=np.float32)

    def _hidden(self, ids: mx.array, mask: mx.array) -> mx.array:
        """Last hidden states [B, L, H]."""
        if self.family == "decoder":
            cache = None
            if self.bidirectional:
                cache = [_MaskOnly(mask)] * len(self.model.layers)
            return self.model(ids, cache=cache)  # type: ignore[no-any-return]
        if self.model_type == "modernbert":
            # Its Model pools by itself; the backbone gives the token states.
            out = self.model.model(ids, attention_mask=mask)  # type: ignore[operator]
            return out["last_hidden_state"]  # type: ignore[no-any-return]
        return self.model(ids, attention_mask=mask).last_hidden_state  # type: ignore[no-any-return]


class _MaskOnly:
    """The mlx-lm cache seam used for a mask only: attention over every real token
    of the row (a bidirectional decoder), nothing stored."""

    offset = 0

    def __init__(self, mask: mx.array) -> None:
        self._mask = (mask > 0)[:, None, None, :]  # [B, 1, 1, T]: which keys are real

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return keys, values

    def make_mask(self, n: int, **kwargs: Any) -> mx.array:
        return self._mask


def pool(hidden: mx.array, mask: mx.array, mode: str) -> mx.array:
    """Pool right-padded hidden states [B, L, H] with ``mask`` [B, L] (1 = real token).

    >>> h = mx.array([[[1.0, 0.0], [3.0, 2.0], [9.0, 9.0]]]); m = mx.array([[1.0, 1.0, 0.0]])
    >>> pool(h, m, "mean").tolist(), pool(h, m, "last").tolist()
    ([[2.0, 1.0]], [[3.0, 2.0]])
    """
    if mode == "cls":
        return hidden[:, 0]
    m = mask[:, :, None]
    if mode == "mean":
        return (hidden * m).sum(axis=1) / mx.maximum(m.sum(axis=1), 1.0)
    if mode == "max":
        return mx.where(m > 0, hidden, -mx.inf).max(axis=1)
    if mode == "last":
        last = mask.sum(axis=1).astype(mx.int32) - 1
        return mx.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    raise ValueError(f"unknown pooling {mode!r}")


def normalize(x: mx.array) -> mx.array:
    """Rows scaled to unit L2 norm (a zero row stays zero)."""
    return x / mx.maximum(mx.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


# ------------------------------------------------------------------ loading


def _pooling(folder: Path, family: str) -> str:
    path = folder / "1_Pooling" / "config.json"
    if not path.is_file():
        return "last" if family == "decoder" else "mean"
    cfg = _read_json(path)
    chosen = [mode for key, mode in _ST_POOLING.items() if cfg.get(key)]
    others = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v]
    if len(chosen) != 1 or len(others) != 1:
        raise ModelLoadError(
            f"1_Pooling/config.json asks for {', '.join(others) or 'no pooling'}; "
            f"supported: exactly one of {', '.join(_ST_POOLING)}"
        )
    return chosen[0]


def _max_length(folder: Path, limit: int) -> int:
    """The longest input: sentence-transformers' ``max_seq_length`` when given, never
    past what the position table holds."""
    st = folder / "sentence_bert_config.json"
    if st.is_file():
        n = _read_json(st).get("max_seq_length")
        if isinstance(n, int) and 0 < n < limit:
            return n
    return limit


def _position_limit(config: dict[str, Any]) -> int:
    n = int(config.get("max_position_embeddings") or 512)
    if _model_type(config) in ("xlm-roberta", "xlm_roberta"):
        # RoBERTa numbers positions from pad_token_id + 1 (514 rows hold 512 tokens).
        n -= int(config.get("pad_token_id", 1)) + 1
    return max(1, n)


def _matryoshka(config: dict[str, Any], family: str, pooling: str, full: int) -> Matryoshka | None:
    """Matryoshka sizes: ``matryoshka_dimensions`` in config.json (jina-embeddings-v3's
    key), or the Qwen3-Embedding family (a qwen3 decoder pooling the last token)."""
    sizes = config.get("matryoshka_dimensions")
    if isinstance(sizes, list) and sizes and all(isinstance(s, int) and s > 0 for s in sizes):
        return Matryoshka(min(sizes), tuple(sorted(set(sizes))))
    if family == "decoder" and _model_type(config) == "qwen3" and pooling == "last":
        return Matryoshka(min(MATRYOSHKA_FLOOR, full))
    return None


def _safetensors(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights")
    return files


def _load_decoder(folder: Path, config: dict[str, Any], dtype: str) -> tuple[nn.Module, str]:
    """mlx-lm's backbone (``Model.model``) with the checkpoint's weights; the LM head,
    if any, is never materialized. Checkpoints saved from the bare backbone (no
    ``model.`` prefix, as Qwen3-Embedding's) load too."""
    model = zoo.build_model(config, None)
    backbone = model.get("model") if isinstance(model, nn.Module) else None
    if not isinstance(backbone, nn.Module) or not hasattr(backbone, "layers"):
        raise ModelLoadError(f"model_type {_model_type(config)!r}: no backbone to embed with")
    weights: dict[str, mx.array] = {}
    for f in _safetensors(folder):
        weights.update(mx.load(str(f)))  # type: ignore[arg-type]
    weights = {
        k if k.startswith(("model.", "lm_head.")) else f"model.{k}": v for k, v in weights.items()
    }
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    weights = {k: v for k, v in weights.items() if k.startswith("model.")}
    if config.get("quantization"):
        zoo._quantize_like_mlx_lm(model, config, weights)
    try:
        backbone.load_weights([(k[len("model.") :], v) for k, v in weights.items()], strict=True)
    except ValueError as e:
        raise ModelLoadError(f"checkpoint does not match the architecture: {e}") from None
    compute, dequant = resolve_dtype(dtype, zoo.checkpoint_dtype(backbone))
    zoo.settle(backbone, compute, dequant=dequant)
    from mlx_cairn.backends import cpu

    cpu.install(backbone, compute, layout=False)
    return backbone, dtype_name(compute)


def _load_encoder(folder: Path, config: dict[str, Any], dtype: str) -> tuple[nn.Module, str]:
    """mlx-embeddings' own loader (its sanitize and quantization handling)."""
    mt = _model_type(config)
    if mt not in ENCODER_TYPES:
        raise ModelLoadError(
            f"encoder model_type {mt!r} is not implemented by mlx-embeddings; supported: "
            + ", ".join(sorted(set(ENCODER_TYPES)))
        )
    try:
        from mlx_embeddings.utils import load_model
    except ImportError:
        raise ModelLoadError(
            f"{folder.name} is a {mt} encoder: encoders run on mlx-embeddings, which is not "
            "installed; pip install 'mlx-cairn[embeddings]'"
        ) from None

    overrides = {"model_type": ENCODER_TYPES[mt]}
    try:
        model = load_model(folder, lazy=True, model_config=overrides)
    except Exception as e:  # whatever its loader trips on is a bad checkpoint to us
        raise ModelLoadError(f"mlx-embeddings cannot load {folder.name}: {e}") from None
    compute, dequant = resolve_dtype(dtype, zoo.checkpoint_dtype(model))
    zoo.settle(model, compute, dequant=dequant)
    return model, dtype_name(compute)


def load_embedding_model(folder: Path, *, dtype: str = "auto") -> EmbeddingModel:
    """Load an embedding model folder (see the module doc); ModelLoadError when it is not one."""
    family = embedding_family(folder)
    if family is None:
        raise ModelLoadError(f"{folder} is not an embedding model")
    config = _read_json(folder / "config.json")
    modules = _st_modules(folder) or []
    unknown = [m for m in modules if m not in _ST_MODULES]
    if unknown:
        raise ModelLoadError(
            f"modules.json lists {', '.join(unknown)}: only Transformer, Pooling and "
            "Normalize modules are supported"
        )
    if not (folder / "tokenizer.json").is_file():
        raise ModelLoadError(f"{folder} has no tokenizer.json")
    try:
        tokenizer = EmbeddingTokenizer(HFTokenizer.from_file(str(folder / "tokenizer.json")))
    except Exception as e:  # tokenizers raises plain Exception on bad JSON
        raise ModelLoadError(f"cannot read tokenizer.json: {e}") from None
    pooling = _pooling(folder, family)
    if family == "decoder":
        model, tag = _load_decoder(folder, config, dtype)
    else:
        model, tag = _load_encoder(folder, config, dtype)
    full = int(config.get("hidden_size") or 0)
    params = sum(int(v.size) for _, v in _flat(model))
    pad = config.get("pad_token_id")
    return EmbeddingModel(
        name=folder.name,
        family=family,
        model_type=_model_type(config),
        model=model,
        tokenizer=tokenizer,
        pooling=pooling,
        dimensions=full,
        max_length=_max_length(folder, _position_limit(config)),
        pad_id=int(pad) if isinstance(pad, int) else 0,
        identity=f"{folder.name}@{weights_identity([folder / 'config.json', *_safetensors(folder)], tag)}:{tag}",
        path=str(folder),
        matryoshka=_matryoshka(config, family, pooling, full),
        bidirectional=family == "decoder"
        and (config.get("is_causal") is False or bool(config.get("use_bidirectional_attention"))),
        num_parameters=params,
        vocab_size=int(config.get("vocab_size") or tokenizer.vocab_size),
    )


def _flat(model: nn.Module) -> list[tuple[str, mx.array]]:
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())  # type: ignore[return-value]


def forward_budget(model: EmbeddingModel, flops: float) -> int:
    """Tokens one forward of about ``flops`` covers (2 FLOPs per parameter per token)."""
    return max(1, math.floor(flops / max(1, 2 * model.num_parameters)))

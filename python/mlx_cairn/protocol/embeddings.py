"""Embedding requests and answers: OpenAI ``/v1/embeddings`` and Ollama's two shapes.

Every check on the body runs here, before any model work (400s); the checks
that need the model (``dimensions``, input lengths, token ids) run in the
route once the model is known, still before anything is queued::

    req = parse_openai(body)                      # input, encoding_format, dimensions
    check_dimensions(req.dimensions, model)       # Matryoshka models only
    vecs = cut(result.vectors, req.dimensions)    # truncate, then normalize again
    body = openai_body(vecs, req, name, tokens)   # floats, or base64 of little-endian f32

The limits below are OpenAI's, and apply to every shape.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlx_cairn.errors import InvalidRequest
from mlx_cairn.protocol.codec import fail, is_int, required_model

#: Inputs in one request at most (OpenAI's limit).
MAX_INPUTS = 2048
#: Tokens summed over a request's inputs at most (OpenAI's limit).
MAX_REQUEST_TOKENS = 300_000
#: ``encoding_format`` values.
ENCODINGS = ("float", "base64")


@dataclass(slots=True)
class EmbeddingRequest:
    """One embedding request, whatever its shape: texts or token ids, never both."""

    model: str
    texts: list[str] | None = None
    ids: list[list[int]] | None = None
    encoding_format: str = "float"
    dimensions: int | None = None
    #: Cut inputs longer than the model takes (Ollama) instead of a 400 (OpenAI).
    truncate: bool = False
    #: The request field holding the inputs, as errors name it.
    param: str = "input"

    @property
    def count(self) -> int:
        return len(self.texts if self.texts is not None else self.ids or [])


def _dimensions(body: dict[str, Any]) -> int | None:
    v = body.get("dimensions")
    if v is None:
        return None
    if not is_int(v) or v < 1:
        raise fail("dimensions", "must be a positive integer")
    return int(v)


def _token_list(v: list[Any], param: str) -> list[int]:
    if not v:
        raise fail(param, "a token list must not be empty")
    for t in v:
        if not is_int(t) or t < 0:
            raise fail(param, "token ids must be non-negative integers")
    return [int(t) for t in v]


def parse_openai(body: Any) -> EmbeddingRequest:
    """``POST /v1/embeddings``: ``input`` is a string, a list of strings, a list of
    token ids or a list of token-id lists; ``encoding_format``, ``dimensions``.

    >>> parse_openai({"model": "m", "input": [[1, 2], [3]]}).ids
    [[1, 2], [3]]
    """
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    model = required_model(body)
    fmt = body.get("encoding_format", "float")
    if fmt is None:
        fmt = "float"
    if fmt not in ENCODINGS:
        raise fail("encoding_format", "must be 'float' or 'base64'")
    req = EmbeddingRequest(model, encoding_format=fmt, dimensions=_dimensions(body))
    raw = body.get("input")
    if raw is None:
        raise fail("input", "field required")
    if isinstance(raw, str):
        raw = [raw]
    elif not isinstance(raw, list) or not raw:
        raise fail("input", "must be a string or a non-empty list")
    elif all(is_int(t) for t in raw):
        raw = [raw]  # one input given as token ids
    if len(raw) > MAX_INPUTS:
        raise fail("input", f"at most {MAX_INPUTS} inputs per request")
    if all(isinstance(x, str) for x in raw):
        for i, x in enumerate(raw):
            if not x:
                raise fail(f"input[{i}]", "must not be empty")
        req.texts = list(raw)
    elif all(isinstance(x, list) for x in raw):
        req.ids = [_token_list(x, f"input[{i}]") for i, x in enumerate(raw)]
    else:
        raise fail("input", "must be all strings, or all token-id lists")
    return req


def _ollama_common(body: Any) -> tuple[str, dict[str, Any]]:
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    model = required_model(body)
    # ``options`` (num_ctx, ...) and ``keep_alive`` are accepted and have no effect here.
    options = body.get("options")
    if options is not None and not isinstance(options, dict):
        raise fail("options", "must be an object")
    return model, body


def parse_ollama_embed(body: Any) -> EmbeddingRequest:
    """Ollama ``POST /api/embed``: ``input`` a string or a list of strings (absent
    or empty: no vectors, the model is only loaded), ``truncate`` (default true),
    ``dimensions``.

    >>> parse_ollama_embed({"model": "m", "input": "hi"}).texts
    ['hi']
    """
    model, body = _ollama_common(body)
    truncate = body.get("truncate", True)
    if not isinstance(truncate, bool):
        raise fail("truncate", "must be a boolean")
    raw = body.get("input")
    if raw is None or raw == "":
        texts: list[str] = []
    elif isinstance(raw, str):
        texts = [raw]
    elif isinstance(raw, list) and all(isinstance(x, str) for x in raw):
        texts = list(raw)
    else:
        raise fail("input", "must be a string or a list of strings")
    if len(texts) > MAX_INPUTS:
        raise fail("input", f"at most {MAX_INPUTS} inputs per request")
    for i, x in enumerate(texts):
        if not x:
            raise fail(f"input[{i}]", "must not be empty")
    return EmbeddingRequest(model, texts=texts, dimensions=_dimensions(body), truncate=truncate)


def parse_ollama_embeddings(body: Any) -> EmbeddingRequest:
    """Ollama's legacy ``POST /api/embeddings``: one ``prompt`` (absent or empty: an
    empty vector), cut to the model's length."""
    model, body = _ollama_common(body)
    prompt = body.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise fail("prompt", "must be a string")
    return EmbeddingRequest(model, texts=[prompt] if prompt else [], truncate=True, param="prompt")


def check_dimensions(dimensions: int | None, model: Any) -> None:
    """A 400 unless ``model`` may give vectors of ``dimensions`` (its full width always may)."""
    full = int(model.dimensions)
    if dimensions is None or dimensions == full:
        return
    mrl = model.matryoshka
    if mrl is None:
        raise fail(
            "dimensions",
            f"model {model.name!r} gives {full}-dimensional vectors and was not trained "
            "to be truncated (Matryoshka); leave dimensions out",
        )
    if not mrl.allows(dimensions, full):
        sizes = (
            ", ".join(map(str, mrl.sizes)) if mrl.sizes is not None else f"{mrl.smallest} to {full}"
        )
        raise fail("dimensions", f"model {model.name!r} allows {sizes}, not {dimensions}")


def check_total(tokens: int, param: str) -> None:
    if tokens > MAX_REQUEST_TOKENS:
        raise fail(
            param, f"{tokens} tokens over all inputs; at most {MAX_REQUEST_TOKENS} per request"
        )


def cut(vectors: np.ndarray, dimensions: int | None) -> np.ndarray:
    """The first ``dimensions`` of each vector, scaled back to unit length (Matryoshka).

    >>> cut(np.array([[0.6, 0.8, 0.0]], np.float32), 1).tolist()
    [[1.0]]
    """
    if dimensions is None or dimensions >= vectors.shape[1]:
        return vectors
    head = vectors[:, :dimensions]
    norms = np.maximum(np.linalg.norm(head, axis=1, keepdims=True), 1e-12)
    return (head / norms).astype(np.float32)


def b64(vector: np.ndarray) -> str:
    """OpenAI's ``base64`` encoding: the little-endian float32 bytes of one vector."""
    return base64.b64encode(np.ascontiguousarray(vector, dtype="<f4").tobytes()).decode()


def openai_body(
    vectors: np.ndarray, req: EmbeddingRequest, model: str, tokens: int
) -> dict[str, Any]:
    """The ``/v1/embeddings`` answer (an ``object: list`` of ``embedding`` entries)."""
    encode = b64 if req.encoding_format == "base64" else lambda v: v.tolist()
    data = [
        {"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(vectors)
    ]
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def ollama_embed_body(
    vectors: np.ndarray, model: str, tokens: int, *, total_ns: int, load_ns: int
) -> dict[str, Any]:
    """The ``/api/embed`` answer (durations in nanoseconds, as Ollama reports them)."""
    return {
        "model": model,
        "embeddings": vectors.tolist(),
        "total_duration": total_ns,
        "load_duration": load_ns,
        "prompt_eval_count": tokens,
    }


def ollama_embeddings_body(vectors: np.ndarray) -> dict[str, Any]:
    """The legacy ``/api/embeddings`` answer: one vector (empty for an empty prompt)."""
    return {"embedding": vectors[0].tolist() if len(vectors) else []}

"""mlx-lm's architectures, unmodified, over our caches (docs/design.md §4, issue 14).

The model class for a ``config.json`` comes from ``mlx_lm.models.<model_type>``
(with mlx-lm's own remaps); its weights load through mlx-lm's sanitize and
quantization handling. :class:`ZooModel` wraps it in the interface the engine
calls::

    h = model(tokens, cache)           # hidden states [B, L, hidden] (after the final norm)
    logits = model.logits(h[:, -1])    # [B, vocab] fp32, only where they are needed
    model.layer_specs                  # per-layer KV shapes and windows (pool sizing)

``cache`` is any object with ``layer_caches(model)``: the engine's
:class:`~mlx_cairn.engine.paged.PagedKVCache` (per-layer views over the block
pools) or :class:`~mlx_cairn.models.cache.ContiguousKVCache` (mlx-lm's own
caches, for the one-sequence reference loop).

Logits only where needed: mlx-lm's ``Model.__call__`` is ``head(self.model(x))``
for nearly every architecture. :meth:`ZooModel.logits` runs that same method
with ``self.model`` replaced by a pass-through, so tied embeddings, logit
scaling and soft-capping stay mlx-lm's. An architecture whose ``__call__`` is
not of that shape runs whole, and ``logits`` only casts.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_cairn.errors import ModelLoadError
from mlx_cairn.models.base import LayerSpec, StateEntry

#: mlx_lm.models modules that are helpers, not architectures.
_HELPERS = frozenset(
    {
        "activations",
        "base",
        "bitlinear_layers",
        "cache",
        "gated_delta",
        "mla",
        "pipeline",
        "rope_utils",
        "ssm",
        "switch_layers",
    }
)


def mlx_lm_version() -> str:
    from mlx_lm import __version__

    return str(__version__)


def known_model_types() -> list[str]:
    """Every ``model_type`` module mlx-lm ships (attention, hybrid and recurrent alike)."""
    import mlx_lm.models as pkg

    return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_"))


def _unsupported(model_type: object, why: str) -> ModelLoadError:
    return ModelLoadError(
        f"unsupported model architecture {model_type!r}: {why}. Supported: the attention "
        f"architectures of mlx-lm {mlx_lm_version()} (e.g. llama, mistral, qwen2, qwen3, "
        "qwen3_moe, gemma3_text, phi3, gpt_oss, glm4_moe, deepseek_v3, mixtral) and its "
        "hybrids with KV and recurrent-state layers (qwen3_next, qwen3_5, qwen3_5_moe, lfm2, "
        "lfm2_moe, nemotron_h, granitemoehybrid, falcon_h1, mamba2, ...)"
    )


def model_classes(config: dict[str, Any]) -> tuple[Any, Any]:
    """mlx-lm's ``(Model, ModelArgs)`` for ``config`` (its remaps), or a ModelLoadError."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ModelLoadError("config.json has no model_type")
    if model_type in _HELPERS:
        raise _unsupported(model_type, "not a model_type mlx-lm knows")
    from mlx_lm.utils import _get_classes

    try:
        classes = _get_classes(config)
    except ValueError:
        raise _unsupported(model_type, "not a model_type mlx-lm knows") from None
    except Exception as e:  # an architecture module that fails to import
        raise _unsupported(model_type, f"mlx-lm cannot import it ({e})") from None
    lacking = _lacking_cache_kinds(classes[0])
    if lacking:
        raise _unsupported(model_type, _needs(lacking[0]))
    return classes  # type: ignore[no-any-return]


#: mlx-lm cache kinds the engine has no pools for (chunked attention, quantized KV).
_LACKING = ("MambaCache", "ChunkedKVCache", "QuantizedKVCache")


def _needs(kind: str) -> str:
    return f"its layers need a {kind}, a cache kind this engine does not have"


def _lacking_cache_kinds(model_cls: type) -> list[str]:
    """Cache kinds ``model_cls.make_cache`` builds that we lack, read from its source.

    This refuses hybrids by name before any weight is read (their configs may
    not even build); :func:`layer_specs` checks the built caches again.
    """
    make = getattr(model_cls, "make_cache", None)
    if make is None:
        return []
    try:
        src = inspect.getsource(make)
    except (OSError, TypeError):
        return []
    return [k for k in _LACKING if f"{k}(" in src]


def _quantize_like_mlx_lm(
    model: nn.Module, config: dict[str, Any], weights: dict[str, mx.array]
) -> None:
    """Quantize the modules that arrive quantized (``config["quantization"]``, per-layer
    overrides included), as ``mlx_lm.utils.load_model`` does."""
    from mlx_lm.utils import infer_quant_config

    q = config["quantization"]

    def predicate(path: str, module: nn.Module) -> bool | dict[str, Any]:
        if path in q:
            return q[path]  # type: ignore[no-any-return]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return infer_quant_config(path, module, weights)  # type: ignore[no-any-return]

    nn.quantize(
        model,
        group_size=q["group_size"],
        bits=q["bits"],
        mode=q.get("mode", "affine"),
        class_predicate=predicate,
    )


def build_model(config: dict[str, Any], weights: dict[str, mx.array] | None) -> nn.Module:
    """An mlx-lm model for ``config`` with ``weights`` (HF names; None keeps its random init).

    Weights may be MLX-quantized when ``config["quantization"]`` says so
    (per-layer overrides included). This is the in-memory path (GGUF readers,
    tests); folders go through :func:`load_folder`, which reads every
    ``quantization_config`` variant mlx-lm reads.
    """
    model_cls, args_cls = model_classes(config)
    try:
        model = model_cls(args_cls.from_dict(config))
    except (TypeError, KeyError, ValueError) as e:
        raise ModelLoadError(f"config.json does not fit {config['model_type']}: {e}") from None
    if weights is None:
        return model
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    if config.get("quantization"):
        _quantize_like_mlx_lm(model, config, weights)
    model.eval()
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ModelLoadError(f"checkpoint does not match the architecture: {e}") from None
    return model


def load_folder(folder: Path) -> tuple[nn.Module, dict[str, Any]]:
    """``mlx_lm.utils.load_model`` on ``folder`` (lazy), errors as ModelLoadError."""
    from mlx_lm.utils import load_config, load_model

    config = load_config(folder)
    model_classes(config)  # an unknown model_type is named before any weight is read
    try:
        model, config = load_model(folder, lazy=True)
    except Exception as e:  # whatever mlx-lm's loader trips on is a bad checkpoint to us
        q = config.get("quantization_config") or config.get("quantization") or {}
        method = q.get("quant_method") if isinstance(q, dict) else None
        what = f"model_type {config.get('model_type')!r}" + (
            f", quantization {method}" if method else ""
        )
        if isinstance(e, ValueError) and ("parameters" in str(e) or "shape" in str(e)):
            what += "; the checkpoint does not match the architecture"
        raise ModelLoadError(
            f"cannot load {folder.name} ({what}) with mlx-lm: {type(e).__name__}: {e}"
        ) from None
    return model, config


def dequantize_model(model: nn.Module, dtype: mx.Dtype) -> int:
    """Replace quantized linears, embeddings and expert stacks by dense ``dtype`` ones.

    On the CPU backend fp32 is the fast path (docs/design.md §5). Modules of other
    quantized kinds stay as they are. Returns the number of modules replaced.
    """
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    def dense(m: nn.Module) -> mx.array:
        return mx.dequantize(
            m["weight"],
            m["scales"],
            m.get("biases"),
            group_size=m.group_size,
            bits=m.bits,
            mode=getattr(m, "mode", "affine"),
        ).astype(dtype)

    replaced: list[tuple[str, nn.Module]] = []
    for path, m in model.named_modules():
        new: nn.Module | None = None
        if isinstance(m, nn.QuantizedLinear):
            w = dense(m)
            new = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
            new.weight = w
            if "bias" in m:
                new.bias = m["bias"].astype(dtype)
        elif isinstance(m, nn.QuantizedEmbedding):
            w = dense(m)
            new = nn.Embedding(w.shape[0], w.shape[1])
            new.weight = w
        elif isinstance(m, QuantizedSwitchLinear) and m.global_scale is None:
            w = dense(m)
            e, o, i = w.shape
            new = SwitchLinear(i, o, e, bias="bias" in m)
            new.weight = w
            if "bias" in m:
                new.bias = m["bias"].astype(dtype)
        if new is not None:
            replaced.append((path, new))
    if replaced:
        model.update_modules(_unflatten_modules(replaced))
    return len(replaced)


def _unflatten_modules(items: list[tuple[str, nn.Module]]) -> dict[str, Any]:
    from mlx.utils import tree_unflatten

    return tree_unflatten(items)  # type: ignore[no-any-return]


def cast_floats(model: nn.Module, dtype: mx.Dtype) -> None:
    """Cast floating parameters to ``dtype``; quantization scales and biases stay as they are."""
    quant_owned: set[int] = set()
    for _, m in model.named_modules():
        if hasattr(m, "scales") and hasattr(m, "bits"):
            for name in ("scales", "biases"):
                if name in m and isinstance(m[name], mx.array):
                    quant_owned.add(id(m[name]))
    flat: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    out = [
        (k, v.astype(dtype))
        for k, v in flat
        if mx.issubdtype(v.dtype, mx.floating) and v.dtype != dtype and id(v) not in quant_owned
    ]
    if out:
        model.load_weights(out, strict=False)


# --------------------------------------------------------------------- cache kinds


class _Probe:
    """A cache that only records what one layer stores (shapes are known before evaluation)."""

    offset = 0
    #: What mlx-lm's pipelines read and replace (``cache[-1].keys = mx.depends(...)``).
    keys = mx.zeros((1,))

    def __init__(self) -> None:
        self.shapes: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.shapes = (tuple(keys.shape), tuple(values.shape))
        return keys, values

    def make_mask(self, N: int, **kwargs: Any) -> None:
        return None

    def is_trimmable(self) -> bool:
        return False


def _state_probe(size: int) -> Any:
    """An mlx-lm ``ArraysCache`` of ``size`` entries that records what the layer stores."""
    from mlx_lm.models.cache import ArraysCache

    class StateProbe(ArraysCache):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(size)
            self.stored: dict[int, mx.array] = {}

        def __setitem__(self, idx: int, value: mx.array) -> None:
            self.stored[idx] = value
            super().__setitem__(idx, value)

    return StateProbe()


class _Recording(list):  # type: ignore[type-arg]
    """A cache's list of state arrays that also records what is stored in it."""

    def __init__(self, size: int, sink: dict[int, mx.array]) -> None:
        super().__init__([None] * size)
        self._sink = sink

    def __setitem__(self, idx: Any, value: Any) -> None:
        super().__setitem__(idx, value)
        self._sink[idx] = value


def _vlm_state_probe(c: Any) -> Any:
    """A probe for mlx-vlm's ``ArraysCache`` (its layers store into ``cache.cache[i]``
    directly, through ``update_window`` / ``update_recurrent``)."""
    probe = type(c)(len(c.cache))
    probe.stored = {}
    probe.cache = _Recording(len(c.cache), probe.stored)
    return probe


def _probe_for(c: Any) -> Any:
    """A probe standing in for mlx-lm cache ``c`` (a CacheList gets a list of probes)."""
    from mlx_lm.models.cache import ArraysCache, CacheList

    if isinstance(c, CacheList):
        return CacheList(*(_probe_for(x) for x in c.caches))
    if isinstance(c, ArraysCache):
        return _state_probe(len(c.cache))
    if type(c).__module__ == "mlx_vlm.models.cache" and type(c).__name__ == "ArraysCache":
        return _vlm_state_probe(c)
    return _Probe()


def _kinds(c: Any, model_type: object) -> tuple[str, int | None]:
    """``("kv", window)`` / ``("state", None)`` / ``("both", window)`` of mlx-lm cache ``c``."""
    from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

    # mlx-vlm's language models make their own caches of the same kinds.
    vlm = type(c).__module__ == "mlx_vlm.models.cache"
    name = type(c).__name__
    if type(c) is KVCache or (vlm and name == "KVCache"):
        return "kv", None
    if (type(c) is RotatingKVCache or (vlm and name == "RotatingKVCache")) and c.keep == 0:
        return "kv", int(c.max_size)
    if type(c) is ArraysCache or (vlm and name == "ArraysCache"):
        return "state", None
    if isinstance(c, CacheList) and len(c.caches) == 2:
        a, b = (_kinds(x, model_type) for x in c.caches)
        if {a[0], b[0]} == {"kv", "state"}:
            return "both", a[1] if a[0] == "kv" else b[1]
    raise _unsupported(model_type, _needs(type(c).__name__))


def _spec_of(i: int, probe: Any, window: int | None, model_type: object) -> LayerSpec:
    from mlx_lm.models.cache import CacheList

    parts = list(probe.caches) if isinstance(probe, CacheList) else [probe]
    kv = next((p for p in parts if isinstance(p, _Probe)), None)
    st = next((p for p in parts if not isinstance(p, _Probe)), None)
    kh = kd = vd = 0
    if kv is not None:
        if kv.shapes is None:
            raise _unsupported(model_type, f"layer {i} stores no keys (shared-KV layers)")
        (_, kh, _, kd), (_, vh, _, vd) = kv.shapes
        if kh != vh:
            raise _unsupported(model_type, f"layer {i} has {kh} key heads but {vh} value heads")
    state: tuple[StateEntry, ...] = ()
    if st is not None:
        n = len(st.cache)
        if sorted(st.stored) != list(range(n)):
            raise _unsupported(model_type, f"layer {i} does not store all {n} state arrays")
        state = tuple(
            StateEntry(tuple(st.stored[e].shape[1:]), st.stored[e].dtype) for e in range(n)
        )
    return LayerSpec(kv_heads=kh, k_dim=kd, v_dim=vd, window=window, state=state)


def _calls_once(model: nn.Module, attr: str) -> bool:
    """Whether ``type(model).__call__`` calls ``self.<attr>(`` exactly once."""
    inner = getattr(model, attr, None)
    if not isinstance(inner, nn.Module) or not callable(inner):
        return False
    try:
        src = inspect.getsource(type(model).__call__)
    except (OSError, TypeError):
        return False
    return src.count(f"self.{attr}(") == 1


def _split(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """``(head_owner, backbone)``: the Model whose ``__call__`` is ``head(self.model(...))``
    and its ``.model``, looking through wrappers that only delegate to
    ``self.language_model(...)`` (multimodal checkpoints such as gemma3, mistral3)."""
    for _ in range(3):
        if _calls_once(model, "model"):
            return model, model.model
        if not _calls_once(model, "language_model"):
            return None
        model = model.language_model
    return None


def _backbone(model: nn.Module) -> nn.Module | None:
    split = _split(model)
    return None if split is None else split[1]


def layer_specs(model: nn.Module) -> list[LayerSpec]:
    """Per-layer cache spec of an mlx-lm model, or a ModelLoadError naming a kind we lack.

    Windows come from the model's own ``make_cache`` (``RotatingKVCache(max_size)``
    is a sliding-window layer; ``ArraysCache`` a recurrent one; a ``CacheList``
    of both a layer with both); K/V heads and widths, and the shapes of the
    recurrent state arrays, from a one-token forward pass over probe caches
    that is built but never evaluated.
    """
    from mlx_lm.models.cache import KVCache

    model_type = getattr(model, "model_type", None) or type(model).__module__.rsplit(".", 1)[-1]
    layers = getattr(model, "layers", None)
    if layers is None:
        raise _unsupported(model_type, "the model has no layers list")
    made = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in layers]
    windows = [_kinds(c, model_type)[1] for c in made]
    probes = [_probe_for(c) for c in made]
    tokens = mx.zeros((1, 1), dtype=mx.int32)
    backbone = _backbone(model)
    try:
        if backbone is not None:
            backbone(tokens, cache=probes)
        else:
            model(tokens, cache=probes)
    except Exception as e:
        raise _unsupported(
            model_type, f"its forward pass does not run over our caches ({e})"
        ) from e
    return [
        _spec_of(i, p, w, model_type) for i, (p, w) in enumerate(zip(probes, windows, strict=True))
    ]


# --------------------------------------------------------------------- the wrapper


class _PassThrough:
    """Stands in for ``model.model`` while ``Model.__call__`` applies the head to given hidden states."""

    def __init__(self, real: nn.Module) -> None:
        self._real = real

    def __call__(self, x: mx.array | None = None, *args: Any, **kwargs: Any) -> mx.array:
        # Some heads call ``self.model(inputs=..., ...)`` by keyword (mlx-vlm's Mistral 3).
        return x if x is not None else kwargs.get("inputs")  # type: ignore[return-value]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _HeadOnly:
    """``self`` for ``Model.__call__``: the real model, except ``.model`` passes hidden states through."""

    def __init__(self, real: nn.Module, backbone: nn.Module) -> None:
        self._real = real
        self.model = _PassThrough(backbone)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class ZooModel:
    """An mlx-lm model in the engine's model interface (see the module docstring).

    Example::

        zm = ZooModel(build_model(config, weights), config)
        h = zm(mx.array([[1, 2, 3]]), ContiguousKVCache(zm.num_layers))
        logits = zm.logits(h[:, -1, :])
    """

    def __init__(self, model: nn.Module, config: dict[str, Any]) -> None:
        self.inner = model
        self.config = config
        self.model_type = str(config.get("model_type"))
        self.layer_specs = layer_specs(model)
        self.num_layers = len(self.layer_specs)
        # Uniform summaries for callers that size one pool shape (the widest layer).
        self.num_kv_heads = max(s.kv_heads for s in self.layer_specs)
        self.head_dim = max(max(s.k_dim, s.v_dim) for s in self.layer_specs)
        split = _split(model)
        self._backbone = None if split is None else split[1]
        #: The Model whose __call__ applies the head (model itself, or a wrapped one).
        self._head_owner = model if split is None else split[0]
        self._head_self = None if split is None else _HeadOnly(split[0], split[1])
        self.vocab_size = int(
            config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size") or 0
        )

    @property
    def dtype(self) -> mx.Dtype:
        """The compute dtype (of the first floating parameter that is not a quantization table)."""
        flat: list[tuple[str, mx.array]] = tree_flatten(self.inner.parameters())  # type: ignore[assignment]
        for k, v in flat:
            if mx.issubdtype(v.dtype, mx.floating) and not k.endswith((".scales", ".biases")):
                return v.dtype
        return mx.float32

    @property
    def computes_logits_in_call(self) -> bool:
        """True for an architecture that runs whole (``__call__`` already returns logits)."""
        return self._backbone is None

    def make_cache(self) -> list[Any]:
        """mlx-lm's own per-layer caches for one sequence (the reference loop)."""
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.inner)

    def __call__(self, tokens: mx.array, cache: Any) -> mx.array:
        caches = cache.layer_caches(self)
        if self._backbone is not None:
            return self._backbone(tokens, cache=caches)  # type: ignore[no-any-return]
        return self.inner(tokens, cache=caches)  # type: ignore[no-any-return]

    def logits(self, hidden: mx.array) -> mx.array:
        if self._head_self is None:
            return hidden.astype(mx.float32)
        out = type(self._head_owner).__call__(self._head_self, hidden)
        return out.astype(mx.float32)  # type: ignore[no-any-return]

    @property
    def args(self) -> Any:
        """mlx-lm's ModelArgs of the model (``model_type``, dims, RoPE settings)."""
        owner = self._head_owner
        return getattr(owner, "args", None) or getattr(self.inner, "args", None)

    def load_weights(self, weights: list[tuple[str, mx.array]], strict: bool = True) -> None:
        self.inner.load_weights(weights, strict=strict)

    # nn.Module-like access for code that walks the weights (materialize, identity, export).
    def modules(self) -> list[nn.Module]:
        return self.inner.modules()  # type: ignore[no-any-return]

    def named_modules(self) -> list[tuple[str, nn.Module]]:
        return self.inner.named_modules()  # type: ignore[no-any-return]

    def parameters(self) -> dict[str, Any]:
        return self.inner.parameters()  # type: ignore[no-any-return]

    def __iter__(self) -> Iterator[Any]:  # pragma: no cover - guard against misuse
        raise TypeError("ZooModel is not iterable")


def settle(model: nn.Module, compute: mx.Dtype, *, dequant: bool) -> None:
    """Dequantize (``dequant``), cast the floats to ``compute``, evaluate the weights."""
    if dequant:
        dequantize_model(model, compute)
    cast_floats(model, compute)
    mx.eval(model.parameters())


def finish(
    model: nn.Module, config: dict[str, Any], *, compute: mx.Dtype, dequant: bool
) -> ZooModel:
    """Dequantize (CPU), cast to the compute dtype, evaluate, wrap."""
    settle(model, compute, dequant=dequant)
    from mlx_cairn.backends import cpu

    cpu.install(model, compute)
    return ZooModel(model, config)


def from_weights(
    config: dict[str, Any],
    weights: dict[str, mx.array],
    *,
    compute: mx.Dtype,
    dequant: bool,
) -> ZooModel:
    """A ZooModel from an HF-style config dict and HF-named weights (the GGUF path).

    Weights may be MLX-quantized (``config["quantization"]``); ``dequant``
    turns them dense in ``compute`` (the CPU default).
    """
    return finish(build_model(config, weights), config, compute=compute, dequant=dequant)


def checkpoint_dtype(model: nn.Module) -> mx.Dtype | None:
    """The floating dtype the checkpoint stores its (non-quantization) weights in."""
    flat: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    for k, v in flat:
        if k.endswith("norm.weight") and mx.issubdtype(v.dtype, mx.floating):
            return v.dtype
    for k, v in flat:
        if mx.issubdtype(v.dtype, mx.floating) and not k.endswith((".scales", ".biases")):
            return v.dtype
    return None


def is_quantized(model: nn.Module) -> bool:
    return any(hasattr(m, "scales") and hasattr(m, "bits") for _, m in model.named_modules())


def supported(config: dict[str, Any]) -> bool:
    """Whether mlx-lm has a module for ``config``'s model_type (its cache kinds are checked at load)."""
    try:
        model_classes(config)
    except ModelLoadError:
        return False
    return True


def import_arch(model_type: str) -> Any:
    """The ``mlx_lm.models`` module of ``model_type`` (no remap)."""
    return importlib.import_module(f"mlx_lm.models.{model_type}")

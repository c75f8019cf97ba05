"""Vision-language models: mlx-vlm's towers, projectors and processors; our engine for the rest.

A folder whose ``config.json`` has a ``vision_config`` and whose ``model_type``
mlx-vlm implements loads with mlx-vlm's own model class and processor
(:func:`load_vision_model`, called by ``models.load`` for such folders). The language model inside it runs over the
engine's paged KV pools like any text model (:class:`VisionZooModel`, a
:class:`~mlx_cairn.models.zoo.ZooModel` over ``model.language_model``);
pictures enter as embeddings::

    prompt:   ... <start_of_image> ...         the template writes one placeholder per image
    expand:   ... \\n\\n<boi><img>x256<eoi>\\n\\n ...  the processor's own expansion (exact counts)
    features: mlx-vlm's get_input_embeddings over that span alone, once per picture
              (an LRU keyed by the picture's digest)
    forward:  embed_tokens(ids), the span's rows replaced by its features, through the
              language model's layers (prefill chunks take the slice they cover)

Positions: models with multimodal RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
Qwen3.5) get per-row position ids: the prompt's from the model's
``get_rope_index``, the positions after it shifted by the prompt's rope delta.
Qwen3-VL's deepstack features are added after its early layers at the visual
positions of each row's chunk. Qwen3.5's recurrent layers keep their state in
the engine's state slots, seen through mlx-vlm's ``ArraysCache`` API.

Prefix cache: :attr:`Media.hash_ids` is the prompt with every token of an
image span replaced by an id derived from the picture's digest (above any
vocabulary), which is what the block hashes see; the model is fed the real ids.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_cairn.errors import InvalidRequest, ModelLoadError
from mlx_cairn.models.zoo import ZooModel, checkpoint_dtype, settle
from mlx_cairn.types import ChatRequest, Image

#: Vision-tower outputs kept per model (pictures; each a few hundred rows of hidden size).
FEATURE_CACHE_IMAGES = 64
#: ... and at most this many bytes of them (a 1k-token picture of a 4k-wide model: 16 MiB).
FEATURE_CACHE_BYTES = 512 << 20
#: Processor outputs kept per model (token expansion and pixel values of a picture).
PROCESSOR_CACHE_IMAGES = 64
#: ... and at most this many bytes of pixel values.
PROCESSOR_CACHE_BYTES = 256 << 20
#: Hash ids of image positions: this bit set (above any vocabulary, below 2**31),
#: 28-bit slices of the digest below it.
_HASH_ID_BIT = 1 << 30


def vision_model_type(config: dict[str, Any]) -> str | None:
    """mlx-vlm's model_type for a vision-language ``config``, or None (a text model)."""
    if not isinstance(config.get("vision_config"), dict):
        return None
    try:
        from mlx_vlm.utils import get_model_and_args
    except ImportError:  # pragma: no cover - mlx-vlm is a dependency of the [vision] extra
        return None
    try:
        _, model_type = get_model_and_args(config)
    except (ValueError, KeyError, ImportError):
        return None
    return str(model_type)


# --------------------------------------------------------------------- prompts


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """One picture in a prompt: its tokens ``[start, start + len(ids))``."""

    start: int
    ids: tuple[int, ...]
    image: Image
    #: The processor's pixel values and extra inputs (``image_grid_thw``, ...) for it alone.
    pixel_values: Any
    extra: dict[str, Any]

    @property
    def end(self) -> int:
        return self.start + len(self.ids)


@dataclass(slots=True)
class Media:
    """The pictures of one prompt (``PreparedRequest.media``)."""

    spans: tuple[ImageSpan, ...]
    #: Prompt ids as the prefix cache hashes them (image positions carry the digest).
    hash_ids: list[int]
    prompt_ids: list[int]
    #: Multimodal RoPE: [3, P] positions of the prompt and the shift after it (lazy).
    positions: np.ndarray | None = None
    rope_delta: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True, slots=True)
class Features:
    """What a picture's span feeds the language model."""

    #: [len(span), hidden]: the span's input embeddings.
    embeds: mx.array
    #: Qwen3-VL's deepstack: per early layer, [visual tokens, hidden] added to its
    #: output at the visual positions (None for other models).
    deepstack: list[mx.array] | None = None
    #: [len(span)] which of the span's positions are visual tokens (with deepstack).
    visual: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return int(self.embeds.nbytes) + sum(int(d.nbytes) for d in self.deepstack or ())


def _hash_ids(digest: str, n: int) -> list[int]:
    """The ids the block hashes see at a picture's ``n`` positions: 28-bit slices of its
    digest in turn (252 of its 256 bits over any 9 positions), above every vocabulary."""
    parts = [int(digest[k : k + 7], 16) for k in range(0, len(digest) - 6, 7)]
    return [_HASH_ID_BIT | parts[i % len(parts)] for i in range(n)]


class Vision:
    """A model's processor and its caches: prompt expansion and vision features.

    Example::

        prompt = vision.expand(prompt, request)   # image placeholders -> the model's tokens
        feats = vision.features(span).embeds     # [len(span.ids), hidden], cached by digest
    """

    def __init__(self, vlm: nn.Module, processor: Any, model_type: str) -> None:
        self.vlm = vlm
        self.processor = processor
        self.model_type = model_type
        tok = getattr(processor, "tokenizer", processor)
        ph = getattr(processor, "boi_token", None) or getattr(processor, "image_token", None)
        if not isinstance(ph, str):
            raise ModelLoadError(f"the {model_type} processor names no image token")
        self.placeholder = ph
        ph_id = tok.convert_tokens_to_ids(ph)
        if not isinstance(ph_id, int) or ph_id < 0:
            raise ModelLoadError(f"the image token {ph!r} is not in the vocabulary")
        self.placeholder_id = ph_id
        self._features: OrderedDict[str, Features] = OrderedDict()
        self._processed: OrderedDict[str, tuple[tuple[int, ...], Any, dict[str, Any]]] = (
            OrderedDict()
        )
        self._lock = threading.Lock()
        #: Vision-tower runs (a re-sent picture whose features are cached runs none).
        self.encoded = 0

    # ------------------------------------------------------------- any thread

    def _process(self, image: Image) -> tuple[tuple[int, ...], Any, dict[str, Any]]:
        """The processor on one picture: its token span, pixel values and extra inputs."""
        with self._lock:
            got = self._processed.get(image.digest)
            if got is not None:
                self._processed.move_to_end(image.digest)
                return got
        from mlx_vlm.utils import process_inputs

        try:
            out = process_inputs(
                self.processor,
                prompts=[self.placeholder],
                images=[image.pixels],
                add_special_tokens=False,
                padding=False,
            )
        except Exception as e:
            raise InvalidRequest(f"the image could not be processed: {e}", param="messages") from e
        ids = tuple(int(t) for t in np.asarray(out["input_ids"]).reshape(-1).tolist())
        extra = {
            k: v
            for k, v in dict(out).items()
            if k not in ("input_ids", "attention_mask", "pixel_values", "token_type_ids")
            and v is not None
        }
        # Host copies: arrays made here must not be lazy on this thread's stream.
        extra = {k: np.asarray(v) for k, v in extra.items()}
        got = (ids, np.asarray(out["pixel_values"]), extra)
        with self._lock:
            self._processed[image.digest] = got
            while len(self._processed) > 1 and (
                len(self._processed) > PROCESSOR_CACHE_IMAGES
                or sum(v[1].nbytes for v in self._processed.values()) > PROCESSOR_CACHE_BYTES
            ):
                self._processed.popitem(last=False)
        return got

    def expand(self, prompt: Any, request: ChatRequest) -> Any:
        """``prompt`` with each image placeholder the template wrote replaced by the
        processor's tokens for that picture, and its :class:`Media` attached."""
        images = [img for m in request.messages for img in m.images]
        if not images:
            return prompt
        ids = list(prompt.ids)
        at = [i for i, t in enumerate(ids) if t == self.placeholder_id]
        if len(at) != len(images):
            raise InvalidRequest(
                f"the chat template placed {len(at)} image(s) but the request has {len(images)}",
                param="messages",
            )
        out: list[int] = []
        spans = []
        prev = 0
        for pos, image in zip(at, images, strict=True):
            span_ids, pixels, extra = self._process(image)
            out.extend(ids[prev:pos])
            spans.append(ImageSpan(len(out), span_ids, image, pixels, extra))
            out.extend(span_ids)
            prev = pos + 1
        out.extend(ids[prev:])
        hash_ids = list(out)
        for s in spans:
            hash_ids[s.start : s.end] = _hash_ids(s.image.digest, len(s.ids))
        last_user_at = prompt.last_user_at
        if last_user_at is not None:
            last_user_at += sum(
                len(s.ids) - 1 for s, p in zip(spans, at, strict=True) if p < last_user_at
            )
        media = Media(tuple(spans), hash_ids, out)
        return replace(prompt, ids=out, last_user_at=last_user_at, media=media)

    # ------------------------------------------------------------- engine thread

    def features(self, span: ImageSpan) -> Features:
        """The embeddings of ``span`` (the vision tower's output at the image tokens,
        the token embeddings elsewhere), and Qwen3-VL's deepstack features, cached by digest."""
        digest = span.image.digest
        got = self._features.get(digest)
        if got is not None and got.embeds.shape[0] == len(span.ids):
            self._features.move_to_end(digest)
            return got
        ids = mx.array([list(span.ids)], dtype=mx.int32)
        pixels = span.pixel_values
        if not isinstance(pixels, mx.array):
            pixels = mx.array(np.asarray(pixels))
        extra = {
            k: v if isinstance(v, mx.array) else mx.array(np.asarray(v))
            for k, v in span.extra.items()
        }
        emb = self.vlm.get_input_embeddings(
            ids, pixels, mask=mx.ones(ids.shape, dtype=mx.int32), **extra
        )
        deep = getattr(emb, "deepstack_visual_embeds", None)
        visual = None
        if deep is not None:
            deep = list(deep)
            visual = np.asarray(emb.visual_pos_masks).reshape(-1).astype(bool)
        got = Features(emb.inputs_embeds[0], deep, visual)
        mx.eval(got.embeds, *(deep or []))
        self.encoded += 1
        self._features[digest] = got
        while len(self._features) > 1 and (
            len(self._features) > FEATURE_CACHE_IMAGES
            or sum(f.nbytes for f in self._features.values()) > FEATURE_CACHE_BYTES
        ):
            self._features.popitem(last=False)
        return got

    def positions(self, media: Media) -> tuple[np.ndarray, int]:
        """Multimodal RoPE of ``media``'s prompt: [3, P] positions and the delta after it."""
        with media._lock:
            if media.positions is None:
                lm = self.vlm.language_model
                grids = [s.extra["image_grid_thw"] for s in media.spans]
                grid = mx.concatenate(
                    [g if isinstance(g, mx.array) else mx.array(np.asarray(g)) for g in grids]
                )
                ids = mx.array([media.prompt_ids], dtype=mx.int32)
                pos, delta = lm.get_rope_index(ids, grid, None, mx.ones(ids.shape, dtype=mx.int32))
                media.positions = np.asarray(pos).reshape(3, -1).astype(np.int64)
                media.rope_delta = int(np.asarray(delta).reshape(-1)[0])
            return media.positions, media.rope_delta


# --------------------------------------------------------------------- the model


class VisionZooModel(ZooModel):
    """The language model of an mlx-vlm model in the engine's interface, taking pictures.

    ``model(tokens, cache, feeds)``: ``feeds`` gives per row ``(media, start, n)``
    (media None for a text row): the rows' image spans inside ``[start, start + n)``
    are fed their features instead of the token embeddings.
    """

    takes_images = True

    def __init__(self, vlm: nn.Module, config: dict[str, Any], vision: Vision) -> None:
        super().__init__(vlm.language_model, config)
        self.vlm = vlm
        self.vision = vision
        lm = vlm.language_model
        self.mrope = hasattr(lm, "get_rope_index")
        #: What runs the layers: the backbone, or (Idefics3's) the whole language model,
        #: whose output is then the logits.
        self._body = self._backbone if self._backbone is not None else lm
        self._embed = self._body.embed_tokens
        #: Recurrent layers (Qwen3.5) whose code calls mlx-vlm's ArraysCache API.
        self._vlm_state = any(
            type(c).__module__ == "mlx_vlm.models.cache" and type(c).__name__ == "ArraysCache"
            for c in (lm.make_cache() if hasattr(lm, "make_cache") else ())
        )
        if self.mrope:
            tied = getattr(getattr(lm, "args", None), "tie_word_embeddings", False)
            self._head = self._embed.as_linear if tied or not hasattr(lm, "lm_head") else lm.lm_head
        self.vocab_size = int(self.vocab_size or self._embed.weight.shape[0])

    def modules(self) -> list[nn.Module]:
        return self.vlm.modules()  # type: ignore[no-any-return]

    def named_modules(self) -> list[tuple[str, nn.Module]]:
        return self.vlm.named_modules()  # type: ignore[no-any-return]

    def parameters(self) -> dict[str, Any]:
        return self.vlm.parameters()  # type: ignore[no-any-return]

    def logits(self, hidden: mx.array) -> mx.array:
        if self.mrope:
            return self._head(hidden).astype(mx.float32)  # type: ignore[no-any-return]
        if self._head_self is None:  # the body gave logits already
            return hidden.astype(mx.float32)
        out = type(self._head_owner).__call__(self._head_self, hidden)
        out = getattr(out, "logits", out)
        return out.astype(mx.float32)  # type: ignore[no-any-return]

    def __call__(self, tokens: mx.array, cache: Any, feeds: Any = None) -> mx.array:
        caches = cache.layer_caches(self)
        if self._vlm_state:
            caches = [_vlm_state_view(c) for c in caches]
        if self.model_type in _LOGICAL_KV_TYPES:
            caches = [_LogicalKV(c) if hasattr(c, "_owner") else c for c in caches]
        has_media = feeds is not None and any(f[0] is not None for f in feeds)
        kwargs: dict[str, Any] = {}
        if self.mrope:
            kwargs["position_ids"] = self._positions(tokens.shape, cache, caches, feeds)
        if not has_media:
            return self._run(tokens, None, caches, kwargs)
        emb = self._embed(tokens)
        visual = np.zeros(tokens.shape[:2], dtype=bool)
        deep: list[list[mx.array]] = []
        for b, (media, start, n) in enumerate(feeds):
            if media is None:
                continue
            for span in media.spans:
                lo, hi = max(span.start, start), min(span.end, start + n)
                if lo >= hi:
                    continue
                f = self.vision.features(span)
                a, z = lo - span.start, hi - span.start
                emb[b, lo - start : hi - start] = f.embeds[a:z].astype(emb.dtype)
                if f.deepstack is not None and f.visual is not None:
                    # Rows in order, positions in order: how the layers consume them.
                    mask = f.visual[a:z]
                    visual[b, lo - start : hi - start] = mask
                    first, k = int(f.visual[:a].sum()), int(mask.sum())
                    deep += [[] for _ in range(len(f.deepstack) - len(deep))]
                    for i, d in enumerate(f.deepstack):
                        deep[i].append(d[first : first + k])
        if deep and visual.any():
            kwargs["visual_pos_masks"] = mx.array(visual)
            kwargs["deepstack_visual_embeds"] = [mx.concatenate(p, axis=0) for p in deep]
        return self._run(tokens, emb, caches, kwargs)

    def _run(
        self, tokens: mx.array, emb: mx.array | None, caches: Any, kw: dict[str, Any]
    ) -> mx.array:
        out = self._body(tokens, inputs_embeds=emb, cache=caches, **kw)
        return getattr(out, "logits", out)  # type: ignore[no-any-return]

    def _positions(
        self, shape: tuple[int, ...], cache: Any, caches: list[Any], feeds: Any
    ) -> mx.array:
        """[3, B, L] multimodal RoPE positions of a call's rows."""
        b, n = shape[0], shape[1]
        if hasattr(cache, "_np_offs"):  # the engine's paged view: per-row offsets
            offs = np.asarray(cache._np_offs, dtype=np.int64).reshape(-1)
        else:  # one contiguous sequence (the reference loop)
            at = next(int(c.offset) for c in caches if hasattr(c, "offset"))
            offs = np.full(b, at, dtype=np.int64)
        pos = np.broadcast_to(offs[:, None] + np.arange(n)[None, :], (3, b, n)).copy()
        if feeds is not None:
            for row, (media, start, _) in enumerate(feeds):
                if media is None:
                    continue
                table, delta = self.vision.positions(media)
                want = start + np.arange(n)
                inside = want < table.shape[1]
                got = np.where(
                    inside[None, :], table[:, np.minimum(want, table.shape[1] - 1)], want + delta
                )
                pos[:, row, :] = got
        return mx.array(pos.astype(np.int32))


# --------------------------------------------------------------------- loading


#: Architectures whose attention cuts the mask to the keys' logical length
#: (``offset + L + 1``) before it attends: their keys are cut to match.
_LOGICAL_KV_TYPES = frozenset({"qwen3_5", "qwen3_5_moe"})


class _LogicalKV:
    """A layer's paged cache whose gathered K/V end where the mask a Qwen3.5 layer cuts
    ends (the gather pads them to whole blocks; the padding is masked either way)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        k, v = self._inner.update_and_fetch(keys, values)
        if not isinstance(k, mx.array):
            return k, v
        owner = self._inner._owner
        t = min(k.shape[-2], int(owner._np_offs.max()) + keys.shape[-2] + 1)
        return k[..., :t, :], v[..., :t, :]


class _Forwarding(list):  # type: ignore[type-arg]
    """A row batch's state arrays whose stores also go to the paged cache's slots."""

    def __init__(self, items: list[Any], owner: Any, layer: int) -> None:
        super().__init__(items)
        self._owner, self._layer = owner, layer

    def __setitem__(self, idx: Any, value: Any) -> None:
        super().__setitem__(idx, value)
        self._owner.write_state(self._layer, idx, value)


def _vlm_state_view(c: Any) -> Any:
    """The engine's state cache of one layer (mlx-lm's ArraysCache, over the state
    slots) as mlx-vlm's ArraysCache, whose update methods its recurrent layers call."""
    owner = getattr(c, "owner", None)
    if owner is None:
        return c
    from mlx_vlm.models.cache import ArraysCache

    view = ArraysCache(len(c.cache))
    view.cache = _Forwarding(list(c.cache), owner, c.layer)
    return view


def _route_quantized_kv(lm: nn.Module) -> int:
    """Send attention over quantized KV blocks (``--kv-bits``: the cache has ``bits``)
    in ``lm``'s mlx-vlm modules to mlx-lm's quantized attention, which reads the
    (packed, scales, biases) triples the paged pools give; mlx-vlm's own function
    knows its own quantized caches only. Returns the number of modules patched."""
    import sys

    from mlx_lm.models.base import scaled_dot_product_attention as quantized_aware

    from mlx_cairn.backends.cpu.kernels import model_modules

    patched = 0
    for name in sorted(model_modules(lm)):
        mod = sys.modules.get(name)
        fn = getattr(mod, "scaled_dot_product_attention", None)
        if not name.startswith("mlx_vlm.models.") or fn is None or hasattr(fn, "_cairn_kv"):
            continue

        def routed(
            queries: mx.array,
            keys: Any,
            values: Any,
            cache: Any,
            scale: float,
            mask: Any,
            sinks: Any = None,
            _own: Any = fn,
        ) -> mx.array:
            if hasattr(cache, "bits") and isinstance(keys, tuple):
                return quantized_aware(  # type: ignore[no-any-return]
                    queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks
                )
            return _own(queries, keys, values, cache, scale, mask, sinks)  # type: ignore[no-any-return]

        routed._cairn_kv = fn  # type: ignore[attr-defined]
        mod.scaled_dot_product_attention = routed  # type: ignore[union-attr]
        patched += 1
    return patched


def _materialize_everything(root: Any) -> None:
    """Evaluate every array reachable from ``root``, parameters or not (Pixtral's
    rotary tables live on a plain object): MLX cannot evaluate, on the engine
    thread, a lazy array built on this one."""
    seen: set[int] = set()
    todo = [root]
    found: list[mx.array] = []
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, mx.array):
            found.append(obj)
        elif isinstance(obj, nn.Module):
            todo.extend(obj.values())
            todo.extend(vars(obj).values())
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            todo.extend(obj)
        elif (
            hasattr(obj, "__dict__")
            and not isinstance(obj, type)
            and (type(obj).__module__ or "").startswith("mlx_vlm")
        ):
            todo.extend(vars(obj).values())
    mx.eval(found)


def load_vision_model(
    folder: Path, dtype: str, keep_quantized: bool | None
) -> tuple[VisionZooModel, Vision, dict[str, Any], str]:
    """mlx-vlm's model and processor for ``folder``, wrapped for the engine."""
    from mlx_vlm.utils import load_config, load_model, load_processor

    from mlx_cairn.models.weights import dtype_name, resolve_dtype

    config = load_config(folder)
    model_type = vision_model_type(config)
    if model_type is None:
        raise ModelLoadError(f"mlx-vlm has no vision model {config.get('model_type')!r}")
    try:
        vlm = load_model(folder, lazy=True)
        processor = load_processor(folder, add_detokenizer=False)
    except Exception as e:
        raise ModelLoadError(
            f"cannot load {folder.name} (vision model_type {model_type!r}) with mlx-vlm: "
            f"{type(e).__name__}: {e}"
        ) from None
    compute, dequant = resolve_dtype(dtype, checkpoint_dtype(vlm))
    if keep_quantized is not None:
        dequant = not keep_quantized
    settle(vlm, compute, dequant=dequant)
    _route_quantized_kv(vlm.language_model)
    from mlx_cairn.backends import cpu

    # The language model's dense linears in the layout the CPU multiplies fastest,
    # and its attention on the CPU softmax kernel (as for text models).
    cpu.install(vlm.language_model, compute, prefix="mlx_vlm.models.", activations=False)
    _materialize_everything(vlm)
    vlm.eval()
    vision = Vision(vlm, processor, model_type)
    text_config = dict(config.get("text_config") or config)
    text_config.setdefault("model_type", model_type)
    full = {**config, "vocab_size": text_config.get("vocab_size") or config.get("vocab_size")}
    model = VisionZooModel(vlm, full, vision)
    return model, vision, config, dtype_name(compute)

"""Images from the wire: bytes, base64, ``data:`` and ``http(s)`` URLs -> :class:`Image`.

Every dialect reads its image parts through one :class:`ImageReader` per
request, so the limits and the error wording are decided here once:

- formats: PNG, JPEG, GIF (its first frame) and WebP, recognised by their
  content (Pillow); a declared media type must be one of those four;
- ``max_bytes`` per image (counted before base64 is decoded, from its length),
  ``max_pixels`` per image, checked from the header *before* any pixel is
  decoded (a PNG that declares 30000x30000 is refused without allocating its
  2.7 GB), ``max_images`` per request;
- remote ``http(s)`` URLs only when the operator allows them
  (``cairn serve --allow-image-urls``); the parser then leaves a
  :class:`PendingImage` in ``Message.images`` and the route fetches it with
  :func:`fetch_pending` (async, size and time bounded) before any model work.
  Without the flag a URL is a 400 that says so, and nothing is fetched.

Every failure is an :class:`~mlx_cairn.errors.InvalidRequest` naming the
field (``messages[0].content[1].source.data: ...``), so each dialect answers
it as a 400 in its own envelope.

Each image stands in ``Message.content`` as one :data:`IMAGE_MARK`; client
text never carries the mark (:func:`strip_marks`), so every mark is an image.

Example::

    reader = ImageReader(ImageLimits(max_images=4))
    img = reader.base64(b64_png, "image/png", "messages[0].content[1].source")
    Message("user", f"{IMAGE_MARK}\\nWhat is this?", images=[img])
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import re
import urllib.parse
from dataclasses import dataclass
from typing import Any

import orjson

from mlx_cairn.errors import InvalidRequest
from mlx_cairn.protocol.codec import fail, short
from mlx_cairn.types import IMAGE_MARK, ChatRequest, Image, Message

#: Defaults of ``cairn serve --max-image-pixels / --max-image-bytes / --max-images
#: / --image-url-timeout``: 32 megapixels (a 5K screenshot is 15), 20 MiB per image
#: (as OpenAI's), 100 images per request (as Anthropic's).
DEFAULT_MAX_IMAGE_PIXELS = 32 * 1024 * 1024
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_IMAGES = 100
DEFAULT_IMAGE_URL_TIMEOUT = 10.0

#: Media types accepted, and Pillow's name for each format.
MEDIA_TYPES = {
    "image/png": "PNG",
    "image/jpeg": "JPEG",
    "image/jpg": "JPEG",
    "image/gif": "GIF",
    "image/webp": "WEBP",
}
_FORMATS = ("PNG", "JPEG", "GIF", "WEBP")
_WHAT = "a PNG, JPEG, GIF or WebP image"
_SPACE = re.compile(rb"\s+")
_MARK_BYTES = IMAGE_MARK.encode()


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """The operator's image settings (``cairn serve`` flags)."""

    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_images: int = DEFAULT_MAX_IMAGES
    #: Fetch ``http(s)`` image URLs (``--allow-image-urls``); never otherwise.
    allow_urls: bool = False
    #: Seconds one URL may take, connection to last byte (``--image-url-timeout``).
    url_timeout: float = DEFAULT_IMAGE_URL_TIMEOUT


@dataclass(frozen=True, slots=True)
class PendingImage(Image):
    """An ``http(s)`` image the route still has to fetch (:func:`fetch_pending`);
    it never reaches the engine."""

    url: str = ""
    param: str = ""


class ImageReader:
    """Reads one request's images under :class:`ImageLimits`, counting them."""

    def __init__(self, limits: ImageLimits | None = None) -> None:
        self.limits = limits or ImageLimits()
        self.count = 0

    def _take(self, param: str) -> None:
        self.count += 1
        if self.count > self.limits.max_images:
            raise fail(
                param,
                f"too many images: at most {self.limits.max_images} per request on this server "
                "(--max-images)",
            )

    def base64(self, data: Any, media_type: Any, param: str) -> Image:
        """An image given as base64 text; ``media_type`` None: not declared.

        ``param`` names the field that holds the image; the data is ``param.data``
        unless ``media_type`` is None (Ollama: the string itself is the field).
        """
        self._take(param)
        where = param if media_type is None else f"{param}.data"
        if media_type is not None:
            check_media_type(media_type, f"{param}.media_type")
        if not isinstance(data, str):
            raise fail(where, "must be a base64-encoded string")
        return decode_image(b64_bytes(data, where, self.limits.max_bytes), self.limits, where)

    def url(self, url: Any, param: str) -> Image:
        """An image given as a URL: ``data:`` (decoded now) or ``http(s)`` (a
        :class:`PendingImage` when allowed, else a 400)."""
        self._take(param)
        if not isinstance(url, str) or not url:
            raise fail(param, "must be a non-empty string (a data: or http(s) URL)")
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return self._data_url(url, param)
        if scheme in ("http", "https"):
            if not self.limits.allow_urls:
                raise fail(
                    param,
                    "image URLs are not fetched by this server; send the image inline "
                    "(base64 or a data: URL), or start it with --allow-image-urls",
                )
            return PendingImage(None, "", 0, 0, url=url, param=param)
        raise fail(
            param,
            f"{short(url[:40])} is not a data: or http(s) URL; send the image as a "
            "data: URL (or http(s) where the server allows it)",
        )

    def _data_url(self, url: str, param: str) -> Image:
        head, sep, payload = url[5:].partition(",")
        if not sep:
            raise fail(param, "is not a valid data: URL (no ',')")
        fields = [f.strip() for f in head.split(";")]
        media_type = fields[0].lower() or "text/plain"
        check_media_type(media_type, param)
        if "base64" in (f.lower() for f in fields[1:]):
            raw = b64_bytes(payload, param, self.limits.max_bytes)
        else:
            if len(payload) > 3 * self.limits.max_bytes:
                raise _too_many_bytes(param, self.limits.max_bytes)
            raw = urllib.parse.unquote_to_bytes(payload)
        return decode_image(raw, self.limits, param)


def check_media_type(media_type: Any, param: str) -> None:
    """400 unless ``media_type`` names PNG, JPEG, GIF or WebP."""
    if not isinstance(media_type, str) or media_type.lower() not in MEDIA_TYPES:
        raise fail(
            param,
            f"unsupported image media type {short(media_type)}; "
            "expected image/png, image/jpeg, image/gif or image/webp",
        )


def _too_many_bytes(param: str, limit: int) -> InvalidRequest:
    return fail(
        param, f"image is larger than {limit} bytes, the most this server takes (--max-image-bytes)"
    )


def b64_bytes(text: str, param: str, max_bytes: int) -> bytes:
    """The bytes of base64 ``text`` (whitespace and missing padding tolerated), refused
    by its length before it is decoded when the image would exceed ``max_bytes``."""
    if len(text) > (max_bytes + 2) // 3 * 4 + 4096:  # 4 KiB of slack for line breaks
        raise _too_many_bytes(param, max_bytes)
    try:
        data = text.encode("ascii")
    except UnicodeEncodeError:
        raise fail(param, "is not valid base64 (non-ASCII characters)") from None
    if _SPACE.search(data):
        data = _SPACE.sub(b"", data)
    data += b"=" * (-len(data) % 4)
    try:
        out = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise fail(param, "is not valid base64") from None
    if len(out) > max_bytes:
        raise _too_many_bytes(param, max_bytes)
    if not out:
        raise fail(param, "is empty; expected " + _WHAT)
    return out


def decode_image(data: bytes, limits: ImageLimits, param: str) -> Image:
    """Decode ``data`` (PNG, JPEG, GIF first frame, WebP) into an :class:`Image`.

    The size is read from the header first; a picture above ``limits.max_pixels``
    is refused before its pixels are decoded.
    """
    import PIL.Image
    import PIL.ImageOps

    if len(data) > limits.max_bytes:
        raise _too_many_bytes(param, limits.max_bytes)
    try:
        pic = PIL.Image.open(io.BytesIO(data), formats=_FORMATS)  # reads the header only
    except (PIL.Image.DecompressionBombError, PIL.Image.DecompressionBombWarning):
        # Pillow's own bound (far above ours) tripped while reading the header.
        raise _too_many_pixels(param, None, limits.max_pixels) from None
    except Exception:  # hostile bytes: Pillow's decoders raise more than they document
        raise fail(param, f"is not {_WHAT} (the data could not be read)") from None
    width, height = pic.size
    if width < 1 or height < 1:
        raise fail(param, f"is not {_WHAT} (it declares {width}x{height} pixels)")
    if width * height > limits.max_pixels:
        raise _too_many_pixels(param, (width, height), limits.max_pixels)
    try:
        pic.seek(0)  # an animation's first frame
        pic.load()
        upright = PIL.ImageOps.exif_transpose(pic) or pic  # a phone photo stands upright
        return Image.from_pil(upright)
    except Exception:  # as above: any failure to decode is the data's
        raise fail(param, f"is not {_WHAT} (its data is corrupt or cut short)") from None


def _too_many_pixels(param: str, size: tuple[int, int] | None, limit: int) -> InvalidRequest:
    what = f"{size[0]}x{size[1]} pixels" if size else "too many pixels"
    return fail(
        param,
        f"image is too large: {what}, the most this server takes is {limit} pixels "
        "(--max-image-pixels)",
    )


# ------------------------------------------------------------------ marks


def strip_marks(value: Any) -> Any:
    """``value`` (a decoded JSON body) with :data:`IMAGE_MARK` removed from every
    string and key, in place, so that each mark in a prompt is an image the wire
    placed there. Iterative: any nesting depth that JSON decoding accepted is fine.

    >>> strip_marks({"a": ["x\ue0f0y"]})
    {'a': ['xy']}
    """
    if isinstance(value, str):
        return value.replace(IMAGE_MARK, "") if IMAGE_MARK in value else value
    try:  # the common case, no mark at all, in C: about 1 ms per MB (the walk takes 5)
        if _MARK_BYTES not in orjson.dumps(value):
            return value
    except orjson.JSONEncodeError:  # nested deeper than orjson writes: walk it
        pass
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            marked_keys = []
            for k, v in node.items():
                if isinstance(v, str):
                    if IMAGE_MARK in v:
                        node[k] = v.replace(IMAGE_MARK, "")  # same keys: safe while iterating
                elif isinstance(v, (dict, list)):
                    stack.append(v)
                if isinstance(k, str) and IMAGE_MARK in k:
                    marked_keys.append(k)
            for k in marked_keys:
                node[k.replace(IMAGE_MARK, "")] = node.pop(k)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                if isinstance(v, str):
                    if IMAGE_MARK in v:
                        node[i] = v.replace(IMAGE_MARK, "")
                elif isinstance(v, (dict, list)):
                    stack.append(v)
    return value


def has_images(chat: ChatRequest) -> bool:
    """Whether any message of ``chat`` carries an image."""
    return any(m.images for m in chat.messages)


def takes_images(sm: Any) -> bool:
    """Whether a served model (or a lease, or a loaded model) reads images
    (``LoadedModel.takes_images``)."""
    loaded = getattr(sm, "loaded", sm)
    return bool(getattr(loaded, "takes_images", False))


def refuse_images(chat: ChatRequest, sm: Any, model: str, param: str) -> None:
    """400 when ``chat`` has images and the model ``sm`` reads none (a text model:
    the images would be silently dropped otherwise)."""
    if has_images(chat) and not takes_images(sm):
        raise fail(
            param,
            f"model {model!r} takes no images (it reads text only); send text only, "
            "or serve a vision model",
        )


# ------------------------------------------------------------------ remote


async def fetch_pending(chat: ChatRequest, limits: ImageLimits) -> None:
    """Fetch and decode every :class:`PendingImage` of ``chat`` in place (400 on any
    failure). Each fetch is bounded by ``limits.url_timeout`` and ``limits.max_bytes``;
    decoding runs in a worker thread."""
    todo: list[tuple[Message, int, PendingImage]] = [
        (m, i, img)
        for m in chat.messages
        for i, img in enumerate(m.images)
        if isinstance(img, PendingImage)
    ]
    if not todo:
        return
    import httpx

    async with httpx.AsyncClient(follow_redirects=True, max_redirects=5) as client:
        got = await asyncio.gather(*(_fetch(client, p, limits) for _, _, p in todo))
    for (m, i, _), img in zip(todo, got, strict=True):
        m.images[i] = img


async def _fetch(client: Any, p: PendingImage, limits: ImageLimits) -> Image:
    import httpx

    try:
        data = await asyncio.wait_for(_download(client, p, limits), limits.url_timeout)
    except asyncio.TimeoutError:  # TimeoutError from 3.11 on; not before
        raise fail(
            p.param,
            f"fetching the image took longer than {limits.url_timeout:g} s (--image-url-timeout)",
        ) from None
    except httpx.HTTPError as e:
        raise fail(p.param, f"the image could not be fetched: {type(e).__name__}") from None
    return await asyncio.to_thread(decode_image, data, limits, p.param)


async def _download(client: Any, p: PendingImage, limits: ImageLimits) -> bytes:
    async with client.stream("GET", p.url) as resp:
        if resp.status_code != 200:
            raise fail(p.param, f"fetching the image answered HTTP {resp.status_code}")
        size = resp.headers.get("content-length")
        if size and size.isdigit() and int(size) > limits.max_bytes:
            raise _too_many_bytes(p.param, limits.max_bytes)
        buf = bytearray()
        async for chunk in resp.aiter_bytes():
            buf += chunk
            if len(buf) > limits.max_bytes:
                raise _too_many_bytes(p.param, limits.max_bytes)
        return bytes(buf)

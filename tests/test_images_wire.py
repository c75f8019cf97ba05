"""Images on the wire (issue 34, wire half): decoding and limits, each dialect's
mapping into ``Message.images`` + ``IMAGE_MARK``, the 400 for a text model in
every dialect through the official SDKs, and image URLs (refused by default,
fetched from a loopback server when the operator allows it).

The positive paths through a live server use a tiny *text* model whose
``takes_images`` is set to True in this test only: its engine's ``prepare`` is
wrapped to record the request it receives (so the test sees the decoded
images arrive at the engine) and to hand the engine the text without the
images (a text model has no vision tower to run them through).
"""

from __future__ import annotations

import base64
import dataclasses
import io
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import anthropic
import ollama
import openai
import PIL.Image
import PIL.ImageFile
import pytest
from hypothesis import given
from hypothesis import strategies as st

from live_server import registry_for, serve
from mlx_cairn.api import ServerConfig
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.errors import InvalidRequest
from mlx_cairn.protocol.anthropic import parse_count_tokens_request, parse_messages_request
from mlx_cairn.protocol.images import (
    ImageLimits,
    ImageReader,
    PendingImage,
    decode_image,
    strip_marks,
)
from mlx_cairn.protocol.ollama import parse_chat_request as ollama_chat
from mlx_cairn.protocol.ollama import parse_generate_request as ollama_generate
from mlx_cairn.protocol.openai_chat import parse_chat_request
from mlx_cairn.protocol.openai_responses import parse_responses_request
from mlx_cairn.testing.engine_checks import assert_at_rest
from mlx_cairn.testing.tiny_models import tiny_model
from mlx_cairn.types import IMAGE_MARK, Image, Message

# ------------------------------------------------------------------ pictures


def picture(color: str = "red", size: tuple[int, int] = (8, 6)) -> PIL.Image.Image:
    """A small RGB picture with a few distinct pixels (not one flat color)."""
    pic = PIL.Image.new("RGB", size, color)
    pic.putpixel((0, 0), (1, 2, 3))
    pic.putpixel((size[0] - 1, size[1] - 1), (250, 251, 252))
    return pic


def encoded(pic: PIL.Image.Image, fmt: str, **kw: Any) -> bytes:
    buf = io.BytesIO()
    pic.save(buf, fmt, **kw)
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


PNG = encoded(picture(), "PNG")
PNG_B64 = b64(PNG)
DATA_URL = "data:image/png;base64," + PNG_B64
RED = Image.from_pil(picture())
NOISE_PNG = encoded(PIL.Image.effect_noise((64, 64), 40).convert("RGB"), "PNG")


def png_declaring(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width`` x ``height`` with a few bytes of pixel data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


def refused(match: str) -> Any:
    return pytest.raises(InvalidRequest, match=match)


# ------------------------------------------------------------------ decoding


@pytest.mark.parametrize(
    ("fmt", "kw", "exact"),
    [
        ("PNG", {}, True),
        ("JPEG", {"quality": 95}, False),
        ("WEBP", {"lossless": True}, True),
        ("GIF", {}, True),
    ],
)
def test_each_format_decodes_to_rgb_pixels(fmt: str, kw: dict[str, Any], exact: bool) -> None:
    pic = picture("blue", (12, 9))
    img = decode_image(encoded(pic, fmt, **kw), ImageLimits(), "x")
    assert (img.width, img.height) == (12, 9)
    assert img.pixels.mode == "RGB"
    if exact:  # GIF: the palette holds these few colors exactly
        assert img.pixels.tobytes() == pic.tobytes()
        assert img.digest == Image.from_pil(pic).digest
    else:
        r, g, b = img.pixels.getpixel((6, 4))
        assert b > 200 and r < 40 and g < 40


def test_gif_gives_its_first_frame() -> None:
    frames = [PIL.Image.new("RGB", (10, 10), c) for c in ("red", "lime", "blue")]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    img = decode_image(buf.getvalue(), ImageLimits(), "x")
    assert img.pixels.getpixel((5, 5)) == (255, 0, 0)


def test_same_pixels_same_digest_across_formats_and_different_pixels_differ() -> None:
    pic = picture("green", (16, 16))
    png = decode_image(encoded(pic, "PNG"), ImageLimits(), "x")
    webp = decode_image(encoded(pic, "WEBP", lossless=True), ImageLimits(), "x")
    assert png.digest == webp.digest
    other = pic.copy()
    other.putpixel((8, 8), (0, 0, 0))
    assert decode_image(encoded(other, "PNG"), ImageLimits(), "x").digest != png.digest


def test_a_decompression_bomb_is_refused_from_its_header(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(self: Any) -> None:
        raise AssertionError("pixels were decoded")

    monkeypatch.setattr(PIL.ImageFile.ImageFile, "load", never)
    bomb = png_declaring(30000, 30000)
    with refused("too large"):
        decode_image(bomb, ImageLimits(), "messages[0].content[0].source.data")
    with refused("too large"):  # where Pillow only warns (89M..179M pixels)
        decode_image(png_declaring(10000, 10000), ImageLimits(), "x")
    # Below Pillow's own bound, above ours: our header check refuses it.
    with refused(r"6000x6000 pixels.*--max-image-pixels"):
        decode_image(png_declaring(6000, 6000), ImageLimits(), "x")
    with refused(r"8x6 pixels"):
        decode_image(PNG, ImageLimits(max_pixels=47), "x")
    # Through a dialect, as base64: the same refusal, naming the field.
    body = anthropic_body([image_block(b64(bomb))])
    with refused(r"^messages\[0\]\.content\[0\]\.source\.data: image is too large"):
        parse_messages_request(body, max_tokens_limit=16)


def test_bad_data_is_a_clear_error() -> None:
    reader = ImageReader()
    with refused(r"^p\.data: is not valid base64"):
        reader.base64("iVBOR$$$not-base64", "image/png", "p")
    with refused(r"is not a PNG, JPEG, GIF or WebP image"):
        reader.base64(b64(b"hello, this is text"), "image/png", "p")
    with refused(r"corrupt or cut short"):
        reader.base64(b64(NOISE_PNG[: len(NOISE_PNG) * 2 // 3]), "image/png", "p")
    with refused(r"^p\.media_type: unsupported image media type 'image/bmp'"):
        reader.base64(b64(encoded(picture(), "BMP")), "image/bmp", "p")
    with refused(r"is not a PNG, JPEG, GIF or WebP image"):  # BMP bytes, PNG label
        reader.base64(b64(encoded(picture(), "BMP")), "image/png", "p")
    small = ImageReader(ImageLimits(max_bytes=1000))
    assert len(NOISE_PNG) > 1000
    with refused(r"larger than 1000 bytes.*--max-image-bytes"):
        small.base64(b64(NOISE_PNG), "image/png", "p")
    with refused(r"larger than 1000 bytes"):  # by its length, before it is decoded
        small.base64("A" * 1_000_000, "image/png", "p")
    # Whitespace and missing padding, as some clients send base64, are fine.
    wrapped = "\n".join(PNG_B64[i : i + 60] for i in range(0, len(PNG_B64), 60)).rstrip("=")
    assert reader.base64(wrapped, "image/png", "p").digest == RED.digest


SAMPLES = [
    encoded(picture("teal", (9, 7)), fmt, **kw)
    for fmt, kw in (("PNG", {}), ("JPEG", {}), ("GIF", {}), ("WEBP", {"lossless": True}))
]


@given(
    which=st.integers(0, len(SAMPLES) - 1),
    edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=8),
    cut=st.integers(1, 10_000),
)
def test_mangled_images_decode_or_are_refused(
    which: int, edits: list[tuple[int, int]], cut: int
) -> None:
    """Any byte edits and cuts of a valid file: an Image, or a 400; nothing else."""
    data = bytearray(SAMPLES[which])
    for at, byte in edits:
        data[at % len(data)] = byte
    try:
        img = decode_image(bytes(data[:cut]), ImageLimits(max_pixels=4096), "x")
    except InvalidRequest:
        return
    assert img.pixels.mode == "RGB" and img.width * img.height <= 4096


def test_data_urls() -> None:
    reader = ImageReader()
    assert reader.url(DATA_URL, "u").digest == RED.digest
    with refused(r"^u: unsupported image media type 'text/plain'"):
        reader.url("data:text/plain;base64,aGk=", "u")
    with refused(r"^u: is not a valid data: URL"):
        reader.url("data:image/png;base64", "u")
    with refused(r"^u: 'file:///etc/passwd' is not a data: or http\(s\) URL"):
        reader.url("file:///etc/passwd", "u")


def test_too_many_images_per_request() -> None:
    body = anthropic_body([image_block(), image_block(), image_block()])
    reader = ImageReader(ImageLimits(max_images=2))
    with refused(r"^messages\[0\]\.content\[2\]\.source: too many images: at most 2"):
        parse_messages_request(body, max_tokens_limit=16, images=reader)


# ------------------------------------------------------------------ dialects


def image_block(data: str = PNG_B64, media_type: str = "image/png") -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}


def anthropic_body(content: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": content}]}


def marks_match(m: Message) -> bool:
    return m.content.count(IMAGE_MARK) == len(m.images)


def test_anthropic_user_turn_and_tool_result() -> None:
    body = {
        "model": "m",
        "max_tokens": 8,
        "system": f"sys{IMAGE_MARK}",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": f"look {IMAGE_MARK}here"},
                    image_block(),
                    {"type": "text", "text": "what is it?"},
                ],
            },
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {}}],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [
                            {"type": "text", "text": "file.png"},
                            image_block(
                                b64(encoded(picture(), "WEBP", lossless=True)), "image/webp"
                            ),
                        ],
                    },
                    {"type": "document", "source": {"type": "text", "data": "x"}},
                ],
            },
        ],
    }
    msgs = parse_messages_request(body, max_tokens_limit=16).chat.messages
    system, user, _, tool, after = msgs
    assert system.content == "sys" and not system.images
    assert user.content == f"look here\n{IMAGE_MARK}\nwhat is it?"
    assert [i.digest for i in user.images] == [RED.digest]
    assert tool.role == "tool" and tool.content == f"file.png\n{IMAGE_MARK}"
    assert [i.digest for i in tool.images] == [RED.digest]  # same pixels, other format
    assert "document omitted" in after.content and not after.images
    assert all(marks_match(m) for m in msgs)
    # count_tokens reads the same images.
    counted = parse_count_tokens_request(body).chat.messages
    assert [len(m.images) for m in counted] == [len(m.images) for m in msgs]


def test_anthropic_url_source_refused_unless_allowed() -> None:
    block = {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1:9/x.png"}}
    with refused(r"^messages\[0\]\.content\[0\]\.source\.url: image URLs are not fetched"):
        parse_messages_request(anthropic_body([block]), max_tokens_limit=16)
    allowed = ImageReader(ImageLimits(allow_urls=True))
    msg = parse_messages_request(
        anthropic_body([block]), max_tokens_limit=16, images=allowed
    ).chat.messages[0]
    assert isinstance(msg.images[0], PendingImage)
    assert msg.images[0].url == "http://127.0.0.1:9/x.png"
    with refused(r"source\.type: must be 'base64' or 'url'"):
        parse_messages_request(
            anthropic_body([{"type": "image", "source": {"type": "file", "file_id": "f"}}]),
            max_tokens_limit=16,
        )


def test_openai_chat_image_url_parts() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": f"be{IMAGE_MARK} brief"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": f"a{IMAGE_MARK}"},
                    {"type": "image_url", "image_url": {"url": DATA_URL, "detail": "low"}},
                    {"type": "text", "text": "b"},
                ],
            },
        ],
    }
    system, user = parse_chat_request(body, max_tokens_limit=16).chat.messages
    assert system.content == "be brief"
    assert user.content == f"a{IMAGE_MARK}b"
    assert [i.digest for i in user.images] == [RED.digest]
    body["messages"][1]["content"][1]["image_url"]["url"] = "https://example.com/cat.png"
    with refused(r"^messages\[1\]\.content\[1\]\.image_url\.url: image URLs are not fetched"):
        parse_chat_request(body, max_tokens_limit=16)


def test_openai_responses_input_image() -> None:
    body = {
        "model": "m",
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "what?"},
                    {"type": "input_image", "image_url": DATA_URL},
                ],
            },
            {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
            {
                "type": "function_call_output",
                "call_id": "c1",
                "output": [{"type": "input_image", "image_url": DATA_URL}],
            },
        ],
    }
    user, _, tool = parse_responses_request(
        body, max_tokens_limit=16, lookup=lambda _: []
    ).chat.messages
    assert user.content == f"what?{IMAGE_MARK}" and [i.digest for i in user.images] == [RED.digest]
    assert tool.content == IMAGE_MARK and len(tool.images) == 1
    body["input"][0]["content"][1] = {"type": "input_image", "file_id": "file-1"}
    with refused(r"file_id: uploaded files are not supported"):
        parse_responses_request(body, max_tokens_limit=16, lookup=lambda _: [])


def test_ollama_images_on_messages_and_generate() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": f"what{IMAGE_MARK}?", "images": [PNG_B64]}],
    }
    req = ollama_chat(body, max_tokens_limit=16)
    (user,) = req.chat.messages
    assert user.content == f"{IMAGE_MARK}what?" and user.images[0].digest == RED.digest
    assert req.images == 1
    gen = ollama_generate(
        {"model": "m", "prompt": "describe", "images": [PNG_B64, PNG_B64]}, max_tokens_limit=16
    )
    assert gen.chat.messages[-1].content == IMAGE_MARK * 2 + "describe" and gen.images == 2
    with refused(r"^images: a raw or suffix prompt takes no images"):
        ollama_generate(
            {"model": "m", "prompt": "x", "raw": True, "images": [PNG_B64]}, max_tokens_limit=16
        )
    with refused(r"^messages\[0\]\.images\[0\]: is not valid base64"):
        ollama_chat(
            {"model": "m", "messages": [{"role": "user", "content": "", "images": ["%%%"]}]},
            max_tokens_limit=16,
        )


def test_strip_marks_reaches_every_string_at_any_depth() -> None:
    deep: Any = f"bottom{IMAGE_MARK}"
    for _ in range(5000):
        deep = [deep]
    body = {"a": ["x", {"b": f"y{IMAGE_MARK}"}], f"k{IMAGE_MARK}": IMAGE_MARK, "deep": deep}
    out = strip_marks(body)
    while isinstance(deep, list):
        deep = deep[0]
    assert deep == "bottom"
    del out["deep"]
    assert out == {"a": ["x", {"b": "y"}], "k": ""}


# ------------------------------------------------------------------ live server


class ImageHost:
    """A loopback HTTP server: ``/red.png`` (the PNG), ``/slow.png`` (never answers
    in time), anything else 404; counts the requests it got."""

    def __init__(self) -> None:
        host = self
        self.hits = 0

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                host.hits += 1
                if self.path == "/slow.png":
                    time.sleep(3)
                try:
                    if self.path in ("/red.png", "/slow.png"):
                        self.send_response(200)
                        self.send_header("Content-Type", "image/png")
                        self.send_header("Content-Length", str(len(PNG)))
                        self.end_headers()
                        self.wfile.write(PNG)
                    else:
                        self.send_error(404)
                except OSError:  # the server under test gave up on /slow.png: as it should
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Seen:
    """Wraps an engine's ``prepare``: records each request's images, then lets the
    text model run the text alone (it has no vision tower)."""

    def __init__(self, engine: Engine) -> None:
        self.requests: list[list[list[str]]] = []  # per prepare: each message's digests
        self.counted: list[list[list[str]]] = []  # the same per count_tokens
        prepare, count = engine.prepare, engine.count_tokens

        def text_only(chat: Any, into: list[list[list[str]]]) -> Any:
            into.append([[i.digest for i in m.images] for m in chat.messages])
            assert all(marks_match(m) for m in chat.messages)
            assert not any(isinstance(i, PendingImage) for m in chat.messages for i in m.images)
            messages = [
                dataclasses.replace(m, content=m.content.replace(IMAGE_MARK, ""), images=[])
                for m in chat.messages
            ]
            return dataclasses.replace(chat, messages=messages)

        engine.prepare = lambda chat, **kw: prepare(text_only(chat, self.requests), **kw)  # type: ignore[method-assign]
        engine.count_tokens = lambda chat: count(text_only(chat, self.counted))  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def live() -> Iterator[dict[str, Any]]:
    text = Engine(tiny_model("qwen3"), EngineConfig(num_blocks=128, block_size=16))
    seeing_model = tiny_model("qwen3", seed=1)
    seeing_model.takes_images = True  # test only: see the module doc
    seeing = Engine(seeing_model, EngineConfig(num_blocks=128, block_size=16))
    seen = Seen(seeing)
    host = ImageHost()
    config = ServerConfig(images=ImageLimits(allow_urls=True, url_timeout=1.0, max_images=3))
    try:
        with (
            serve(registry_for({"text": text, "seeing": seeing})) as srv,
            serve(registry_for({"seeing": seeing}), config) as fetching,
        ):
            clients = {
                "anthropic": anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0),
                "openai": openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0),
                "ollama": ollama.Client(host=srv.url, timeout=60),
                "fetching": openai.OpenAI(
                    base_url=fetching.url + "/v1", api_key="x", max_retries=0
                ),
            }
            yield {**clients, "seen": seen, "host": host}
            for c in clients.values():
                c.close()
        assert_at_rest(text)
        assert_at_rest(seeing)
    finally:
        host.close()
        text.close()
        seeing.close()


def user_with_image() -> list[dict[str, Any]]:
    return [{"role": "user", "content": [image_block(), {"type": "text", "text": "what?"}]}]


def chat_with_image(url: str = DATA_URL) -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what?"},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        }
    ]


RESPONSES_INPUT = [
    {
        "role": "user",
        "content": [
            {"type": "input_text", "text": "what?"},
            {"type": "input_image", "image_url": DATA_URL},
        ],
    }
]


def test_a_text_model_refuses_images_in_every_dialect(live: dict[str, Any]) -> None:
    a, oa, o = live["anthropic"], live["openai"], live["ollama"]
    calls = {
        "anthropic": lambda: a.messages.create(
            model="text", max_tokens=4, messages=user_with_image()
        ),
        "anthropic tool_result": lambda: a.messages.create(
            model="text",
            max_tokens=4,
            messages=[
                {"role": "user", "content": "read it"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t", "name": "Read", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t", "content": [image_block()]}
                    ],
                },
            ],
        ),
        "count_tokens": lambda: a.messages.count_tokens(model="text", messages=user_with_image()),
        "chat": lambda: oa.chat.completions.create(
            model="text", max_tokens=4, messages=chat_with_image()
        ),
        "responses": lambda: oa.responses.create(
            model="text", max_output_tokens=4, input=RESPONSES_INPUT
        ),
    }
    for name, call in calls.items():
        with pytest.raises((anthropic.BadRequestError, openai.BadRequestError)) as e:
            call()
        assert e.value.status_code == 400, name
        assert "model 'text' takes no images" in str(e.value), name
        if name in ("anthropic", "anthropic tool_result", "count_tokens"):
            assert e.value.body["error"]["type"] == "invalid_request_error", name
        else:
            assert e.value.body["param"] in ("messages", "input"), name
    for call in (
        lambda: o.chat(model="text", messages=[{"role": "user", "content": "x", "images": [PNG]}]),
        lambda: o.generate(model="text", prompt="x", images=[PNG]),
    ):
        with pytest.raises(ollama.ResponseError) as oe:
            call()
        assert oe.value.status_code == 400 and "takes no images" in oe.value.error
    assert not live["seen"].requests  # none of this reached the engine that reads images


def test_bad_images_are_400s_in_each_envelope(live: dict[str, Any]) -> None:
    a, oa, o = live["anthropic"], live["openai"], live["ollama"]
    bomb = b64(png_declaring(30000, 30000))
    with pytest.raises(anthropic.BadRequestError) as e:
        a.messages.create(
            model="seeing",
            max_tokens=4,
            messages=[{"role": "user", "content": [image_block(bomb)]}],
        )
    assert "image is too large" in e.value.body["error"]["message"]
    with pytest.raises(openai.BadRequestError) as oe:
        oa.chat.completions.create(
            model="seeing", max_tokens=4, messages=chat_with_image("data:image/png;base64,@@@@")
        )
    assert oe.value.body["param"] == "messages[0].content[1].image_url.url"
    assert "not valid base64" in oe.value.body["message"]
    with pytest.raises(openai.BadRequestError) as oe:
        oa.chat.completions.create(
            model="seeing", max_tokens=4, messages=chat_with_image("http://127.0.0.1:9/x.png")
        )
    assert "--allow-image-urls" in oe.value.body["message"]
    with pytest.raises(ollama.ResponseError) as ole:
        o.chat(model="seeing", messages=[{"role": "user", "content": "x", "images": ["AAAA"]}])
    assert ole.value.status_code == 400
    assert ole.value.error.startswith("messages[0].images[0]: is not a PNG")
    assert not live["seen"].requests
    assert live["host"].hits == 0  # nothing was fetched without the flag


def test_images_reach_the_engine_in_every_dialect(live: dict[str, Any]) -> None:
    a, oa, o, seen = live["anthropic"], live["openai"], live["ollama"], live["seen"]
    seen.requests.clear()
    msg = a.messages.create(model="seeing", max_tokens=2, messages=user_with_image())
    assert msg.usage.input_tokens > 0
    n = a.messages.count_tokens(model="seeing", messages=user_with_image()).input_tokens
    assert n == msg.usage.input_tokens
    assert seen.counted[-1] == [[RED.digest]]
    oa.chat.completions.create(
        model="seeing", max_tokens=2, temperature=0, messages=chat_with_image()
    )
    oa.responses.create(model="seeing", max_output_tokens=2, temperature=0, input=RESPONSES_INPUT)
    o.chat(
        model="seeing",
        messages=[{"role": "user", "content": "x", "images": [PNG]}],
        options={"temperature": 0, "num_predict": 2},
    )
    o.generate(
        model="seeing", prompt="x", images=[PNG], options={"temperature": 0, "num_predict": 2}
    )
    assert seen.requests == [[[RED.digest]]] * 5


def test_completions_prompts_lose_the_mark_too(live: dict[str, Any]) -> None:
    oa = live["openai"]

    def tokens(prompt: str) -> int:
        c = oa.completions.create(model="text", prompt=prompt, max_tokens=1, temperature=0)
        return c.usage.prompt_tokens

    assert tokens(f"a{IMAGE_MARK}b{IMAGE_MARK}") == tokens("ab") < tokens("a\ue0f1b\ue0f1")


def test_image_urls_are_fetched_only_when_allowed(live: dict[str, Any]) -> None:
    f, host, seen = live["fetching"], live["host"], live["seen"]
    seen.requests.clear()
    hits = host.hits
    f.chat.completions.create(
        model="seeing", max_tokens=2, temperature=0, messages=chat_with_image(host.url + "/red.png")
    )
    assert host.hits == hits + 1
    assert seen.requests == [[[RED.digest]]]
    with pytest.raises(openai.BadRequestError) as e:
        f.chat.completions.create(
            model="seeing", max_tokens=2, messages=chat_with_image(host.url + "/missing.png")
        )
    assert "answered HTTP 404" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        f.chat.completions.create(
            model="seeing", max_tokens=2, messages=chat_with_image(host.url + "/slow.png")
        )
    assert "longer than 1 s" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # --max-images 3 on this server
        f.chat.completions.create(
            model="seeing",
            max_tokens=2,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": DATA_URL}}] * 4,
                }
            ],
        )
    assert "too many images: at most 3" in e.value.body["message"]
    assert len(seen.requests) == 1


# ------------------------------------------------------- a real vision model


@pytest.fixture(scope="module")
def vision(tmp_path_factory: Any) -> Iterator[dict[str, Any]]:
    pytest.importorskip("mlx_vlm")
    from mlx_cairn.models import load
    from mlx_cairn.testing.tiny_vision import tiny_vision_folder

    lm = load(str(tiny_vision_folder("gemma3", tmp_path_factory.mktemp("gemma3"))))
    engine = Engine(lm, EngineConfig(num_blocks=256, block_size=4))
    try:
        with serve(registry_for({"eyes": engine})) as srv:
            clients = {
                "anthropic": anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0),
                "openai": openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0),
            }
            yield {**clients, "lm": lm, "engine": engine}
            for c in clients.values():
                c.close()
        assert_at_rest(engine)
    finally:
        engine.close()


def noise_png(seed: int) -> str:
    """Base64 PNG of a 28x28 noise picture (the tiny Gemma 3 processor's size)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return b64(
        encoded(PIL.Image.fromarray(rng.integers(0, 256, (28, 28, 3), dtype=np.uint8)), "PNG")
    )


def in_process_text(lm: Any, chat: Any) -> str:
    """The greedy answer of a fresh engine on ``chat`` (what the server must say)."""
    from mlx_cairn.types import TextDelta

    with Engine(lm, EngineConfig(num_blocks=128, block_size=4)) as engine:
        events = list(engine.submit(chat).iter_sync(timeout=120))
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def user_turn(png: str) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": [image_block(png), {"type": "text", "text": "What is it?"}]}
    ]


def read_tool(png: str) -> list[dict[str, Any]]:
    """Claude Code's Read tool on a picture: an image inside a tool_result."""
    return [
        {"role": "user", "content": "Open shot.png"},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "t1", "name": "Read", "input": {"path": "shot.png"}}
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [image_block(png)]}
            ],
        },
    ]


GREEDY = {"temperature": 0}


def check_anthropic_turns(
    vision: dict[str, Any], first: list[dict[str, Any]], other_turn: Any
) -> None:
    """The answer is the in-process engine's on the request as the wire parsed it;
    count_tokens agrees; next turn reads the picture's KV from the cache; the same
    text with another picture does not."""
    a, lm = vision["anthropic"], vision["lm"]
    msg = a.messages.create(model="eyes", max_tokens=6, messages=first, extra_body=GREEDY)
    chat = parse_messages_request(
        {"model": "eyes", "max_tokens": 6, "messages": first, **GREEDY}, max_tokens_limit=64
    ).chat
    assert sum(len(m.images) for m in chat.messages) == 1
    text = "".join(b.text for b in msg.content if b.type == "text")
    assert text and text == in_process_text(lm, chat)
    n = a.messages.count_tokens(model="eyes", messages=first).input_tokens
    # Anthropic's input_tokens leave out what was read from the cache.
    assert n == msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    span = lm.prompt(chat).media.spans[0]

    second = [*first, {"role": "assistant", "content": text or "ok"}]
    second.append({"role": "user", "content": "And the colors?"})
    again = a.messages.create(model="eyes", max_tokens=4, messages=second, extra_body=GREEDY)
    assert again.usage.cache_read_input_tokens >= span.end  # the picture's KV, reused
    other = a.messages.create(model="eyes", max_tokens=4, messages=other_turn, extra_body=GREEDY)
    assert other.usage.cache_read_input_tokens <= span.start


def test_a_vision_model_reads_the_picture_in_a_user_turn(vision: dict[str, Any]) -> None:
    check_anthropic_turns(vision, user_turn(noise_png(1)), user_turn(noise_png(2)))


def test_a_vision_model_reads_the_picture_in_a_tool_result(vision: dict[str, Any]) -> None:
    check_anthropic_turns(vision, read_tool(noise_png(4)), read_tool(noise_png(5)))


def test_a_vision_model_reads_a_chat_image_url_streamed(vision: dict[str, Any]) -> None:
    oa, lm = vision["openai"], vision["lm"]
    url = "data:image/png;base64," + noise_png(3)
    body = {
        "model": "eyes",
        "max_tokens": 6,
        "temperature": 0,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "What is this?"},
                ],
            }
        ],
    }
    chunks = oa.chat.completions.create(**body, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed and streamed == in_process_text(
        lm, parse_chat_request(body, max_tokens_limit=64).chat
    )


def test_serve_flags_reach_the_config() -> None:
    import argparse

    from mlx_cairn.cli.serve import ServeError, add_arguments, build

    def config(*argv: str) -> ServerConfig:
        p = argparse.ArgumentParser()
        add_arguments(p)
        return build(p.parse_args(list(argv)), {})[1]

    assert config().images == ImageLimits()
    assert ImageLimits() == ImageLimits(
        max_pixels=32 * 1024 * 1024,
        max_bytes=20 * 1024 * 1024,
        max_images=100,
        allow_urls=False,
        url_timeout=10.0,
    )
    got = config(
        "--max-image-pixels", "1000", "--max-image-bytes", "2000", "--max-images", "0",
        "--allow-image-urls", "--image-url-timeout", "2.5",
    )  # fmt: skip
    assert got.images == ImageLimits(1000, 2000, 0, True, 2.5)
    with pytest.raises(SystemExit):
        config("--max-image-pixels", "0")
    bad = _parsed()  # a Namespace built in code is checked by build() itself
    bad.image_url_timeout = -1.0
    with pytest.raises(ServeError, match="--image-url-timeout"):
        build(bad, {})


def _parsed() -> Any:
    import argparse

    from mlx_cairn.cli.serve import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args([])

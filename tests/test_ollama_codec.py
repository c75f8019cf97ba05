"""The Ollama dialect without a server: the NDJSON codec and its fold, the request mapper.

For random Event streams (text with whitespace, reasoning, tool calls with
good and bad arguments, token logprobs, every stop reason), every line the
codec emits must be one JSON object the official ``ollama`` client parses,
only the last one final; the JSON answer (the codec's fold) must be what a
client accumulating those very lines, read back from the NDJSON bytes, gets.
"""

from __future__ import annotations

import base64
import io
import math
from typing import Any

import orjson
import PIL.Image
import pytest
from hypothesis import given
from hypothesis import strategies as st
from ollama import ChatResponse, GenerateResponse

from codec_strategies import run, stop_reasons, texts, tool_calls, usages
from mlx_cairn.errors import InvalidRequest
from mlx_cairn.protocol.codec import NDJSON
from mlx_cairn.protocol.ollama import (
    keep_alive,
    load_request,
    parse_chat_request,
    parse_generate_request,
)
from mlx_cairn.protocol.ollama_stream import OllamaCodec
from mlx_cairn.types import (
    Done,
    Error,
    Event,
    ReasoningDelta,
    TextDelta,
    Timings,
    TokenLogprob,
    ToolCall,
    TopLogprob,
)

token_logprobs = st.builds(
    lambda tok, lp, top: TokenLogprob(tok, 3, lp, (), tuple(top)),
    texts,
    st.floats(max_value=0) | st.just(-math.inf),
    st.lists(st.builds(TopLogprob, texts, st.just(4), st.floats(max_value=0)), max_size=2),
)
events = st.lists(
    st.one_of(
        st.builds(TextDelta, texts),
        st.builds(ReasoningDelta, texts),
        tool_calls,
        token_logprobs,
    ),
    max_size=12,
)
dones = st.builds(
    Done,
    stop_reason=stop_reasons,
    usage=usages,
    timings=st.builds(
        Timings,
        st.floats(0, 10),
        st.floats(10, 20),
        st.just(0.0) | st.floats(1e-3, 1e4),
        st.just(0.0) | st.floats(1e-3, 1e4),
    ),
)


def in_order(needle: str, hay: str) -> bool:
    """Whether the characters of ``needle`` occur in ``hay`` in order."""
    it = iter(hay)
    return all(c in it for c in needle)


def clock() -> Any:
    """A fake ``perf_counter_ns``: 1 ms per call."""
    t = iter(range(10**9, 10**12, 10**6))
    return lambda: next(t)


def client_fold(lines: list[dict[str, Any]], shape: str) -> dict[str, Any]:
    """What a client accumulating a stream gets (independent of the server's fold): the
    pieces concatenated in order, the rest from the final line."""
    pieces: dict[str, Any] = {"content": "", "thinking": "", "tool_calls": [], "logprobs": None}
    for line in lines:
        holder = line["message"] if shape == "chat" else line
        pieces["content"] += holder["content" if shape == "chat" else "response"]
        pieces["thinking"] += holder.get("thinking") or ""
        pieces["tool_calls"] += holder.get("tool_calls") or []
        if "logprobs" in line:
            pieces["logprobs"] = (pieces["logprobs"] or []) + line["logprobs"]
    out = {k: v for k, v in lines[-1].items() if k != "logprobs"}
    if shape == "chat":
        msg = {"role": "assistant", "content": pieces["content"]}
        if pieces["thinking"]:
            msg["thinking"] = pieces["thinking"]
        if pieces["tool_calls"]:
            msg["tool_calls"] = pieces["tool_calls"]
        out["message"] = msg
    else:
        out["response"] = pieces["content"]
        if pieces["thinking"]:
            out["thinking"] = pieces["thinking"]
    if pieces["logprobs"] is not None:
        out["logprobs"] = pieces["logprobs"]
    return out


@given(
    evs=events,
    done=dones,
    shape=st.sampled_from(["chat", "generate"]),
    allow_tools=st.booleans(),
    logprobs=st.booleans(),
)
def test_lines_parse_and_fold_to_the_json_answer(
    evs: list[Event], done: Done, shape: str, allow_tools: bool, logprobs: bool
) -> None:
    codec = OllamaCodec(
        model="m:latest",
        shape=shape,  # type: ignore[arg-type]
        allow_tools=allow_tools and shape == "chat",
        logprobs=logprobs,
        clock=clock(),
        now=lambda: "2025-01-01T00:00:00.000000Z",
    )
    wire = run(codec, [*evs, done])
    raw = b"".join(NDJSON.encode(w) for w in wire)
    assert raw.endswith(b"\n") and b"\n\n" not in raw
    lines = [orjson.loads(x) for x in raw.splitlines()]
    model = ChatResponse if shape == "chat" else GenerateResponse
    for i, line in enumerate(lines):
        parsed = model(**line)  # the official client's own type
        assert parsed.done is (i == len(lines) - 1) and parsed.model == "m:latest"
    body = codec.fold(wire)
    assert body == client_fold(lines, shape)
    final = lines[-1]
    assert final["done_reason"] == ("length" if done.stop_reason == "max_tokens" else "stop")
    assert final["eval_count"] == done.usage.output_tokens
    assert final["prompt_eval_count"] == done.usage.input_tokens
    for key in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(final[key], int) and final[key] >= 0, key
    # Nothing is lost: every piece of text is in the answer, tool calls as calls or as text.
    holder = body["message"] if shape == "chat" else body
    text = holder["content" if shape == "chat" else "response"]
    said = "".join(e.text for e in evs if isinstance(e, TextDelta))
    assert in_order("".join(said.split()), text)  # only whitespace before a call may go
    assert holder.get("thinking", "") == "".join(
        e.text for e in evs if isinstance(e, ReasoningDelta)
    )
    calls = [e for e in evs if isinstance(e, ToolCall)]
    got = holder.get("tool_calls", [])
    assert len(got) <= len(calls)
    assert [c["function"]["index"] for c in got] == list(range(len(got)))
    assert len({c["id"] for c in got}) == len(got)
    if logprobs:
        assert len(body["logprobs"]) == sum(isinstance(e, TokenLogprob) for e in evs)
    else:
        assert "logprobs" not in body


def test_an_error_after_the_first_line_is_one_error_line() -> None:
    codec = OllamaCodec(model="m", shape="chat", allow_tools=False)
    wire = codec.feed(TextDelta("hi")) + codec.feed(Error("overloaded", "busy"))
    assert wire[-1] == (None, {"error": "busy"})
    with pytest.raises(ValueError, match="busy"):
        codec.fold(wire)
    assert codec.ping() == b"" and codec.open() == []


# ------------------------------------------------------------------ mapping

LIMIT = 4096


def chat(**kw: Any) -> Any:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}
    return parse_chat_request(body, max_tokens_limit=LIMIT)


def test_options_map_to_sampling() -> None:
    r = chat(
        options={
            "temperature": 0.2,
            "top_p": 0.5,
            "top_k": 7,
            "min_p": 0.1,
            "seed": -3,
            "num_predict": 12,
            "stop": ["x", "y"],
            "repeat_penalty": 1.3,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "num_ctx": 512,
            "mirostat": 2,  # unknown to us: ignored, as Ollama ignores what it does not know
        },
        stream=False,
    )
    sp = r.chat.sampling
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.seed) == (0.2, 0.5, 7, 0.1, -3)
    assert (sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty) == (1.3, 0.5, -0.5)
    assert (r.chat.max_tokens, r.chat.stop, r.context_limit) == (12, ["x", "y"], 512)
    assert not r.stream and not r.open_ended
    for n in (-1, -2, None):
        r = chat(options={"num_predict": n})
        assert r.open_ended and r.chat.max_tokens == LIMIT
    assert chat().stream  # Ollama streams by default


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"options": {"temperature": "hot"}}, "options.temperature"),
        ({"options": {"repeat_penalty": 0}}, "options.repeat_penalty"),
        ({"options": {"num_predict": 0}}, "options.num_predict"),
        ({"options": {"num_predict": LIMIT + 1}}, "options.num_predict"),
        ({"options": {"num_ctx": 0}}, "options.num_ctx"),
        ({"options": {"stop": [""]}}, "options.stop[0]"),
        ({"options": []}, "options"),
        ({"format": "yaml"}, "format"),
        ({"think": "max"}, "think"),
        ({"keep_alive": "soon"}, "keep_alive"),
        ({"stream": "yes"}, "stream"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x", "images": "abc"}]}, "messages[0].images"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "f", "arguments": 1}}],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
        ({"model": ""}, "model"),
    ],
)
def test_bad_fields_are_named(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        chat(**body)
    assert e.value.param == param and e.value.message.startswith(param + ": ")


def test_format_think_and_tools() -> None:
    r = chat(format="json", think="high", tools=[{"function": {"name": "f"}}])
    assert r.chat.output_format is not None and r.chat.output_format.schema is None
    assert r.chat.output_format.param == "format" and not r.chat.output_format.strict
    assert r.chat.reasoning is True and [t.name for t in r.chat.tools] == ["f"]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    r = chat(format=schema, think=False)
    assert r.chat.output_format.schema == schema and r.chat.reasoning is False
    assert chat(format="").chat.output_format is None and chat().chat.reasoning is None


def test_tool_calls_get_stable_ids_and_results_find_their_call() -> None:
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "thinking": "look it up",
            "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"function": {"name": "get_time", "arguments": '{"tz": "CET"}'}},
            ],
        },
        {"role": "tool", "tool_name": "get_time", "content": "12:00"},
        {"role": "tool", "content": "sunny"},
    ]
    first = parse_chat_request({"model": "m", "messages": messages}, max_tokens_limit=LIMIT)
    again = parse_chat_request({"model": "m", "messages": messages}, max_tokens_limit=LIMIT)
    asst, time_result, weather_result = first.chat.messages[1:]
    assert [c.id for c in asst.tool_calls] == ["call_1_0", "call_1_1"]
    assert again.chat.messages == first.chat.messages  # the same prompt, the same cache
    assert asst.reasoning == "look it up"
    assert orjson.loads(asst.tool_calls[1].arguments) == {"tz": "CET"}
    assert (time_result.tool_call_id, time_result.name) == ("call_1_1", "get_time")
    assert (weather_result.tool_call_id, weather_result.name) == ("call_1_0", "get_weather")


def test_generate_shapes() -> None:
    def gen(**kw: Any) -> Any:
        return parse_generate_request({"model": "m", **kw}, max_tokens_limit=LIMIT)

    r = gen(prompt="hi", system="be brief", context=[1, 2])  # context: ignored
    assert [(m.role, m.content) for m in r.chat.messages] == [
        ("system", "be brief"),
        ("user", "hi"),
    ]
    assert r.chat.raw is None and r.prompt_param == "prompt"
    r = gen(prompt="<|im_start|>x", raw=True)
    assert (
        r.chat.messages == [] and r.chat.raw.text == "<|im_start|>x" and r.chat.raw.suffix is None
    )
    r = gen(prompt="def f(", suffix="\n    return 1")
    assert (r.chat.raw.text, r.chat.raw.suffix) == ("def f(", "\n    return 1")
    pixel = io.BytesIO()
    PIL.Image.new("RGB", (1, 1)).save(pixel, "PNG")
    assert gen(prompt="x", images=[base64.b64encode(pixel.getvalue()).decode()]).images == 1
    with pytest.raises(InvalidRequest, match=r"^images\[0\]: is not a PNG"):
        gen(prompt="x", images=["aGk="])
    with pytest.raises(InvalidRequest, match=r"^template: not supported"):
        gen(prompt="x", template="{{ .Prompt }}")
    with pytest.raises(InvalidRequest, match=r"^context: "):
        gen(prompt="x", context="abc")


def test_load_requests() -> None:
    assert load_request({"model": "m"}, "chat") is not None
    assert load_request({"model": "m", "messages": [], "keep_alive": 0}, "chat").keep_alive == 0
    assert load_request({"model": "m", "messages": [{"role": "user"}]}, "chat") is None
    assert load_request({"model": "m", "prompt": ""}, "generate") is not None
    assert load_request({"model": "m", "prompt": "", "suffix": "x"}, "generate") is None
    assert load_request([], "chat") is None
    with pytest.raises(InvalidRequest, match=r"^model: "):
        load_request({"messages": []}, "chat")


def test_keep_alive_durations() -> None:
    assert keep_alive("1h30m") == 5400 and keep_alive("500ms") == 0.5 and keep_alive("0") == 0
    assert keep_alive(-1) == math.inf and keep_alive("-5m") == math.inf
    assert keep_alive(" 10s ") == 10 and keep_alive("1.5h") == 5400
    for bad in ("", "5 m", "m", "1d", "nan", True, [], math.nan):
        with pytest.raises(InvalidRequest, match=r"^keep_alive: "):
            keep_alive(bad)

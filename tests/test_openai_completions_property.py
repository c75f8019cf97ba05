"""Legacy Completions: streamed == JSON, for random Event streams and through the real server.

1. The codec alone: random interleavings of several choices' events (text,
   logprobs, stray reasoning / tool-call events, every stop reason). Every
   chunk must parse as the ``openai`` SDK's ``Completion`` (the model it
   reads stream chunks with); the fold must be
   what the chunks say per choice (texts joined, logprob lists extended, the
   finish reason), and itself parse as a ``Completion``.
2. The server: the scripted model says a random text (markup included: a raw
   prompt's output is plain text) with random stop sequences, caps and ``n``;
   the SDK's stream, accumulated by choice index, equals the JSON answer.

Example counts are the hypothesis profile's, capped to keep the suite short.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types import Completion

import codec_strategies as strategies
from mlx_cairn.protocol.openai_completions import ChoiceEvent, CompletionCodec
from mlx_cairn.testing.engine_checks import assert_at_rest
from mlx_cairn.types import (
    Done,
    Event,
    ReasoningDelta,
    TextDelta,
    TokenLogprob,
    ToolCall,
)
from scripted_model import say
from test_openai_support import normalize, openai_env

texts = st.text(alphabet=st.sampled_from(list('ab \n{}"é😀')), max_size=5)
logprobs_st = st.floats(max_value=0.0) | st.just(-math.inf) | st.just(math.nan)
token_logprobs = strategies.token_logprobs(logprobs_st, texts=texts)
choice_events = st.lists(
    st.one_of(
        st.builds(TextDelta, texts),
        token_logprobs,
        token_logprobs,
        st.builds(ReasoningDelta, texts),
        st.builds(ToolCall, st.just("call_x"), st.just("f"), st.just('{"a": 1}')),
    ),
    max_size=8,
)
done = st.builds(
    Done,
    stop_reason=st.sampled_from(["end_turn", "max_tokens", "stop_sequence"]),
    usage=strategies.usages,
)


def _expected_text(evs: list[Event]) -> str:
    out = ""
    for ev in evs:
        if isinstance(ev, (TextDelta, ReasoningDelta)):
            out += ev.text
        elif isinstance(ev, ToolCall):
            out += '{"name":"f","arguments":{"a":1}}'
    return out


@settings(max_examples=min(settings().max_examples, 60))
@given(
    per_choice=st.lists(st.tuples(choice_events, done), min_size=1, max_size=3),
    order=st.randoms(use_true_random=False),
    logprobs=st.booleans(),
    echo=st.booleans(),
    include_usage=st.booleans(),
    final=done,
)
def test_fold_is_what_the_chunks_say(
    per_choice: list[tuple[list[Event], Done]],
    order: Any,
    logprobs: bool,
    echo: bool,
    include_usage: bool,
    final: Done,
) -> None:
    k = len(per_choice)
    prompts = [f"p{i} " for i in range(k)] if echo else None
    codec = CompletionCodec(
        model="m",
        input_tokens=7,
        include_usage=include_usage,
        echo=prompts,
        num_choices=k,
        logprobs=logprobs,
    )
    # A random interleaving that keeps each choice's own order.
    queues = [[*evs, d] for evs, d in per_choice]
    wire = codec.open()
    while any(queues):
        i = order.choice([j for j, q in enumerate(queues) if q])
        wire += codec.feed(ChoiceEvent(i, queues[i].pop(0)))
    wire += codec.feed(final)
    assert wire[-1] == (None, "[DONE]")
    chunks = [p for _, p in wire if isinstance(p, dict)]
    for chunk in chunks:
        # The SDK reads stream chunks as Completions (finish_reason null until the end).
        finished = [
            {**cc, "finish_reason": cc["finish_reason"] or "stop"} for cc in chunk["choices"]
        ]
        Completion.model_validate({**chunk, "choices": finished})
    body = codec.fold(wire)
    Completion.model_validate(body)
    assert [c["index"] for c in body["choices"]] == list(range(k))
    assert (body["usage"] is not None) == include_usage
    for i, (evs, d) in enumerate(per_choice):
        c = body["choices"][i]
        assert c["text"] == (prompts[i] if prompts else "") + _expected_text(evs)
        assert c["finish_reason"] == ("length" if d.stop_reason == "max_tokens" else "stop")
        tokens = [ev.token for ev in evs if isinstance(ev, TokenLogprob)]
        if not logprobs:
            assert c["logprobs"] is None
            continue
        lp = c["logprobs"]
        assert lp["tokens"] == tokens and len(lp["token_logprobs"]) == len(tokens)
        start = len(prompts[i]) if prompts else 0
        assert lp["text_offset"] == [start + len("".join(tokens[:j])) for j in range(len(tokens))]
        for tok, top, x in zip(tokens, lp["top_logprobs"], lp["token_logprobs"], strict=True):
            assert -9999.0 <= x <= 0.0 and top[tok] == x
        # Each streamed chunk of this choice carries the logprobs of its tokens only.
        streamed = [t for ch in chunks for cc in ch["choices"] if cc["index"] == i
                    for t in cc["logprobs"]["tokens"]]  # fmt: skip
        assert streamed == tokens


# -------------------------------------------------------------------- server


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, Any]]:
    with openai_env() as e:
        yield e


words = st.lists(
    st.sampled_from(["sun", "moon", "é", "日本", "<think>", "</think>", "<tool_call>", "\n", " "]),
    max_size=6,
).map(" ".join)


@settings(max_examples=min(settings().max_examples, 15), deadline=None)
@given(
    text=words,
    stop=st.lists(st.sampled_from(["moon", "日本", "zzz"]), max_size=2),
    cap=st.sampled_from([None, 3, 8]),
    n=st.sampled_from([1, 2]),
    logprobs=st.sampled_from([None, 0, 2]),
)
def test_stream_equals_json_through_the_server(
    env: dict[str, Any], text: str, stop: list[str], cap: int | None, n: int, logprobs: int | None
) -> None:
    c: openai.OpenAI = env["client"]
    kw: dict[str, Any] = {
        "model": "scripted",
        "prompt": f"{say(text)}<|im_start|>assistant\n",
        "temperature": 0,
        "n": n,
        "max_tokens": cap or 64,
    }
    if stop:
        kw["stop"] = stop
    if logprobs is not None:
        kw["logprobs"] = logprobs
    chunks = list(
        c.completions.create(
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"cache_salt": uuid.uuid4().hex},
            **kw,
        )
    )
    plain = c.completions.create(extra_body={"cache_salt": uuid.uuid4().hex}, **kw)
    # The SDK hands stream chunks over as they are: accumulate them by index.
    acc: dict[int, dict[str, Any]] = {}
    for ch in chunks:
        for cc in ch.choices:
            a = acc.setdefault(cc.index, {"text": "", "finish": None, "tokens": []})
            a["text"] += cc.text
            a["finish"] = cc.finish_reason or a["finish"]
            if cc.logprobs is not None:
                a["tokens"] += cc.logprobs.tokens or []
    assert sorted(acc) == [ch.index for ch in plain.choices] == list(range(n))
    for ch in plain.choices:
        assert acc[ch.index]["text"] == ch.text
        assert acc[ch.index]["finish"] == ch.finish_reason
        assert acc[ch.index]["tokens"] == (ch.logprobs.tokens if ch.logprobs else [])
    usage = chunks[-1].usage
    assert usage is not None and plain.usage is not None
    assert normalize(usage.model_dump()) == normalize(plain.usage.model_dump())
    # Nothing of the answer is parsed away: the text is the script, up to a stop or the cap.
    cut = min((text.find(s) for s in stop if s in text), default=len(text))
    if cap is None:
        assert plain.choices[0].text == text[:cut]
    else:  # the cap may cut a stop sequence that had begun (its start is text then),
        # or a character: its bytes so far end the text as U+FFFD
        got = plain.choices[0].text
        assert text.startswith(got.removesuffix("\ufffd")) and not any(s in got for s in stop)


def test_engine_at_rest_afterwards(env: dict[str, Any]) -> None:
    assert_at_rest(env["engines"]["scripted"])

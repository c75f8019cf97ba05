"""Output decoding with special tokens: the parser's tags reach it, other special tokens never
show.

Real tokenizers make many tool-call markers special tokens (Mistral's
``[TOOL_CALLS]``, Llama 3's ``<|python_tag|>``, Hermes 3's ``<tool_call>``,
gpt-oss's channels, DeepSeek's and Kimi's sections, ...), beside BOS,
padding, ``[INST]`` and reserved tokens. Here in-process tokenizers carry
them as special tokens, and model output made of them goes through the
engine's output path (``SequenceOutput``), the engine, and a live server.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest
from tokenizers import AddedToken

from live_server import registry_for, serve
from mlx_cairn.chat import Tokenizer
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.engine.output import SequenceOutput
from mlx_cairn.engine.request import PreparedRequest
from mlx_cairn.testing.engine_checks import assert_at_rest, closing_at_rest
from mlx_cairn.testing.tiny_models import TINY_VOCAB, tiny_tokenizer
from mlx_cairn.text import decode_skips, parser_tags
from mlx_cairn.types import (
    ChatRequest,
    Done,
    Message,
    ReasoningDelta,
    SamplingParams,
    TextDelta,
    Tool,
    ToolCall,
)
from scripted_model import say, scripted_model

WEATHER = Tool(
    "get_weather",
    "Weather of a city",
    {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
)
ARGS = {"city": "Paris", "days": 3}
J = json.dumps(ARGS)

#: Special tokens no parser reads: they must never reach the user.
JUNK = ["<s>", "[INST]", "<|reserved_special_token_0|>", "<pad>"]

#: family -> (reasoning, model output, the family's markers that are special
#: tokens in its models' tokenizers). Each output is "plan" reasoning where
#: the family has it, the text "Checking." and a get_weather call; the junk
#: tokens sit in it where a model could emit them.
CASES: dict[str, tuple[bool, str, list[str]]] = {
    "mistral": (
        True,
        f"[THINK]plan[/THINK]<s>Check[INST]ing.[TOOL_CALLS]get_weather[ARGS]{J}",
        ["[TOOL_CALLS]", "[ARGS]", "[THINK]", "[/THINK]"],
    ),
    "llama3": (
        False,
        f'<s><|python_tag|>{{"name": "get_weather", "parameters": {J}}}',
        ["<|python_tag|>"],
    ),
    "hermes": (
        True,
        f"<think>plan</think>Check<pad>ing.<tool_call>\n"
        f'{{"name": "get_weather", "arguments": {J}}}\n</tool_call>',
        ["<tool_call>", "</tool_call>", "<think>", "</think>"],
    ),
    "qwen3_coder": (
        False,
        "<s>Checking.<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        ["<tool_call>", "</tool_call>"],
    ),
    "harmony": (
        True,
        "<|channel|>analysis<|message|>plan<|end|><|start|>assistant<|channel|>final"
        "<|message|>Check<pad>ing.<|end|><|start|>assistant<|channel|>commentary "
        f"to=functions.get_weather <|constrain|>json<|message|>{J}",
        ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>"],
    ),
    "glm45": (
        True,
        "\n<think>plan</think>\nCheck<pad>ing.<tool_call>get_weather\n<arg_key>city</arg_key>\n"
        "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
        "</tool_call>",
        [
            "<think>",
            "</think>",
            "<tool_call>",
            "</tool_call>",
            "<arg_key>",
            "</arg_key>",
            "<arg_value>",
            "</arg_value>",
        ],
    ),
    "deepseek_v3": (
        True,
        "<think>plan</think><s>Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather"
        f"<｜tool▁sep｜>{J}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        [
            "<｜tool▁calls▁begin｜>",
            "<｜tool▁calls▁end｜>",
            "<｜tool▁call▁begin｜>",
            "<｜tool▁call▁end｜>",
            "<｜tool▁sep｜>",
        ],
    ),
    "kimi_k2": (
        True,
        "<think>plan</think>Check<pad>ing.<|tool_calls_section_begin|><|tool_call_begin|>"
        f"functions.get_weather:0<|tool_call_argument_begin|>{J}<|tool_call_end|>"
        "<|tool_calls_section_end|>",
        [
            "<|tool_calls_section_begin|>",
            "<|tool_calls_section_end|>",
            "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>",
            "<|tool_call_end|>",
        ],
    ),
    "gemma4": (
        True,
        "<|channel>thought\nplan<channel|><s>Checking."
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>',
        ["<|tool_call>", "<tool_call|>", '<|"|>', "<|channel>", "<channel|>"],
    ),
    "minimax_m2": (
        True,
        '<think>plan</think>Check<pad>ing.<minimax:tool_call>\n<invoke name="get_weather">\n'
        '<parameter name="city">Paris</parameter>\n<parameter name="days">3</parameter>\n'
        "</invoke>\n</minimax:tool_call>",
        ["<minimax:tool_call>", "</minimax:tool_call>"],
    ),
    "pythonic": (
        False,
        '<s><|python_start|>[get_weather(city="Paris", days=3)]<|python_end|>',
        ["<|python_start|>", "<|python_end|>"],
    ),
}


def tokenizer_with(specials: list[str]) -> Tokenizer:
    """The tiny tokenizer with ``specials`` and :data:`JUNK` added as special tokens."""
    tok = tiny_tokenizer()
    tok.hf.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in [*specials, *JUNK]]
    )
    assert tok.vocab_size <= TINY_VOCAB
    return tok


def prepared(family: str | None, reasoning: bool, tools: bool = True) -> PreparedRequest:
    req = ChatRequest(messages=[Message("user", "hi")], tools=[WEATHER] if tools else [])
    return PreparedRequest(
        request=req,
        prompt_ids=[1],
        parser_family=family,
        reasoning=reasoning,
        in_reasoning=False,
        salt="",
        max_tokens=100,
        sampling=SamplingParams(),
    )


def decode(tok: Tokenizer, family: str | None, reasoning: bool, text: str) -> list[Any]:
    out = SequenceOutput(tok, prepared(family, reasoning))
    events: list[Any] = []
    for t in tok.encode(text):
        got, stop = out.push(t)
        assert stop is None
        events += got
    return events + out.flush()


def summary(events: list[Any]) -> tuple[str, str, list[tuple[str, Any]]]:
    """(visible text, reasoning, calls)."""
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    thought = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    calls = [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCall)]
    return text, thought, calls


@pytest.mark.parametrize("family", CASES)
def test_markers_that_are_special_tokens_reach_the_parser(family: str) -> None:
    reasoning, text, specials = CASES[family]
    tok = tokenizer_with(specials)
    ids = tok.encode(text)
    # The markers really are single special tokens here.
    for s in specials:
        assert tok.special_tokens[s] in ids, s
    visible, thought, calls = summary(decode(tok, family, reasoning, text))
    assert calls == [("get_weather", ARGS)]
    assert visible.strip() in ("Checking.", "")
    if "Checking." in text:
        assert visible.strip() == "Checking."
    assert thought == ("plan" if reasoning else "")
    for t in [*JUNK, "<|", "|>", "<｜"]:
        assert t not in visible + thought, t


@pytest.mark.parametrize("family", [None, *CASES])
def test_other_special_tokens_never_show(family: str | None) -> None:
    """Plain text with BOS, padding, [INST] and reserved tokens in it, and the
    end-of-turn markers the parser drops: only the words are left."""
    tok = tokenizer_with([])
    text = "<s>Hel<pad>lo[INST] wor<|reserved_special_token_0|>ld<|im_start|>!"
    visible, _, calls = summary(decode(tok, family, False, text))
    assert calls == []
    if family != "harmony":  # gpt-oss's reply outside channels is prose all the same
        assert visible == "Hello world!"
    else:
        assert visible.replace(" ", "") == "Helloworld!"


def test_only_unread_special_tokens_are_skipped() -> None:
    tok = tokenizer_with(CASES["mistral"][2])
    specials = tok.special_tokens
    skip = decode_skips(specials, "mistral", True)
    assert {specials[t] for t in JUNK} <= skip
    for t in ("[TOOL_CALLS]", "[ARGS]", "[THINK]", "[/THINK]", "<|im_end|>"):
        assert specials[t] not in skip, t
    # Reasoning off: [THINK] is no tag of the parser, so it is dropped.
    assert specials["[THINK]"] in decode_skips(specials, "mistral", False)
    # Every family's parser reads the end-of-turn markers it drops.
    for family in [None, *CASES]:
        assert "<|im_end|>" in parser_tags(family, False)


# ---- through the engine and a live server ------------------------------------------


@pytest.fixture(scope="module")
def mistral_engine() -> Iterator[Engine]:
    """The scripted model with Mistral's markers (and junk) as special tokens."""
    lm = scripted_model("mistral-like")
    lm.tokenizer.hf.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in [*CASES["mistral"][2], *JUNK]]
    )
    lm.parser_family = "mistral"
    with closing_at_rest(Engine(lm, EngineConfig(num_blocks=512, block_size=8))) as e:
        yield e


MISTRAL_OUT = f"<s>Check[INST]ing.[TOOL_CALLS]get_weather[ARGS]{J}"


def test_engine_reads_special_token_calls(mistral_engine: Engine) -> None:
    req = ChatRequest(
        messages=[Message("user", say(MISTRAL_OUT))],
        tools=[WEATHER],
        max_tokens=200,
        sampling=SamplingParams(temperature=0.0),
    )
    events = list(mistral_engine.generate_sync(req, timeout=60.0))
    assert isinstance(events[-1], Done)
    visible, _, calls = summary(events)
    assert calls == [("get_weather", ARGS)]
    assert visible == "Checking."


def test_live_server_returns_the_tool_use(mistral_engine: Engine) -> None:
    with (
        serve(registry_for({"m": mistral_engine})) as srv,
        anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0) as client,
    ):
        tool = {"name": WEATHER.name, "description": WEATHER.description,
                "input_schema": WEATHER.parameters}  # fmt: skip
        msg = client.messages.create(
            model="m",
            max_tokens=200,
            messages=[{"role": "user", "content": say(MISTRAL_OUT)}],
            tools=[tool],  # type: ignore[list-item]
        )
        with client.messages.stream(
            model="m",
            max_tokens=200,
            messages=[{"role": "user", "content": say(MISTRAL_OUT)}],
            tools=[tool],  # type: ignore[list-item]
        ) as stream:
            streamed = stream.get_final_message()
    for m in (msg, streamed):
        assert m.stop_reason == "tool_use"
        kinds = [(b.type, getattr(b, "text", None) or getattr(b, "input", None)) for b in m.content]
        assert kinds == [("text", "Checking."), ("tool_use", ARGS)], kinds
    assert_at_rest(mistral_engine)

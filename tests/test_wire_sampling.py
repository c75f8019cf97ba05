"""Sampling controls on the wire: every dialect parses them with one rule per field.

Without a server: what each body maps to in :class:`SamplingParams`, and each
bad value a 400 (:class:`InvalidRequest`) naming its field. Through a live
server: the same 400s arrive in each dialect's own envelope (OpenAI
``error.param``, Anthropic ``{"type": "error", ...}``), also through the
``openai`` SDK.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dialect_parsers import anthropic_request, chat_request, responses_request
from mlx_cairn.errors import InvalidRequest
from mlx_cairn.protocol.sampling import MAX_TOKEN_ID
from mlx_cairn.types import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_REPETITION_PENALTY,
    MAX_TOP_LOGPROBS,
    SamplingParams,
)
from scripted_model import say
from test_openai_support import BEARER, openai_env, user


def anthropic(**kw: Any) -> SamplingParams:
    return anthropic_request(**kw).chat.sampling


def chat(**kw: Any) -> SamplingParams:
    return chat_request(**kw).chat.sampling


def responses(**kw: Any) -> SamplingParams:
    return responses_request(**kw).chat.sampling


Parse = Callable[..., SamplingParams]
DIALECTS: list[tuple[str, Parse]] = [
    ("anthropic", anthropic),
    ("chat", chat),
    ("responses", responses),
]


def refused(parse: Parse, field: str, **kw: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as ei:
        parse(**kw)
    e = ei.value
    assert e.param == field and e.message.startswith(f"{field}: "), (kw, e.param, e.message)
    return e


# ------------------------------------------------------ the shared fields

#: (field, accepted -> mapped value, refused values): the same in every dialect.
SHARED: list[tuple[str, list[tuple[Any, Any]], list[Any]]] = [
    ("frequency_penalty", [(-2, -2.0), (2, 2.0), (0.5, 0.5)], [-2.01, 2.01, "1", True, [], {}]),
    ("presence_penalty", [(-2, -2.0), (2, 2.0), (0, 0.0)], [-3, 2.5, "0", False]),
    (
        "repetition_penalty",
        [(1e-9, 1e-9), (1, 1.0), (MAX_REPETITION_PENALTY, MAX_REPETITION_PENALTY)],
        [0, -1, MAX_REPETITION_PENALTY + 0.01, "1.1", True],
    ),
    ("min_p", [(0, 0.0), (1, 1.0), (0.05, 0.05)], [-0.1, 1.01, "0.1"]),
    ("top_k", [(0, 0), (1, 1), (40, 40)], [-1, 1.5, "4", True]),
    ("seed", [(0, 0), (-(2**63), -(2**63)), (2**64 - 1, 2**64 - 1)], [2**64, 1.0, "7"]),
]


@pytest.mark.parametrize(("dialect", "parse"), DIALECTS, ids=[d for d, _ in DIALECTS])
@pytest.mark.parametrize(("field", "ok", "bad"), SHARED, ids=[f for f, _, _ in SHARED])
def test_shared_fields_one_rule_in_every_dialect(
    dialect: str, parse: Parse, field: str, ok: list[tuple[Any, Any]], bad: list[Any]
) -> None:
    default = getattr(SamplingParams(), field)
    assert getattr(parse(), field) == default
    assert getattr(parse(**{field: None}), field) == default  # null: the default
    for value, mapped in ok:
        got = getattr(parse(**{field: value}), field)
        assert got == mapped and type(got) is type(mapped), (value, got)
    for value in bad:
        refused(parse, field, **{field: value})


@pytest.mark.parametrize(("dialect", "parse"), DIALECTS, ids=[d for d, _ in DIALECTS])
def test_logit_bias_maps_token_ids(dialect: str, parse: Parse) -> None:
    assert parse().logit_bias == {}
    assert parse(logit_bias=None).logit_bias == {}
    assert parse(logit_bias={}).logit_bias == {}
    sp = parse(logit_bias={"0": 100, "42": -100, "7": 0.5, str(MAX_TOKEN_ID): 1})
    assert sp.logit_bias == {0: 100.0, 42: -100.0, 7: 0.5, MAX_TOKEN_ID: 1.0}
    assert all(type(v) is float for v in sp.logit_bias.values())
    assert sp.uses_processors
    full = {str(i): 1 for i in range(MAX_LOGIT_BIAS_ENTRIES)}
    assert len(parse(logit_bias=full).logit_bias) == MAX_LOGIT_BIAS_ENTRIES


BAD_BIAS: list[tuple[Any, str]] = [
    ([1, 2], "logit_bias"),
    ("50256", "logit_bias"),
    (5, "logit_bias"),
    ({"abc": 1}, "logit_bias"),
    ({"-1": 1}, "logit_bias"),
    ({"1.5": 1}, "logit_bias"),
    ({"1e3": 1}, "logit_bias"),
    ({" 12": 1}, "logit_bias"),
    ({"12\n": 1}, "logit_bias"),
    ({"": 1}, "logit_bias"),
    ({"+3": 1}, "logit_bias"),
    ({"٣": 1}, "logit_bias"),  # a digit, but not an ASCII one
    ({str(MAX_TOKEN_ID + 1): 1}, "logit_bias"),
    ({"9" * 5000: 1}, "logit_bias"),  # past int()'s digit limit: still a clean 400
    ({"5": 100.5}, "logit_bias.5"),
    ({"5": -101}, "logit_bias.5"),
    ({"5": "1"}, "logit_bias.5"),
    ({"5": None}, "logit_bias.5"),
    ({"5": True}, "logit_bias.5"),
    ({"5": math.inf}, "logit_bias.5"),
    ({"5": math.nan}, "logit_bias.5"),
    ({str(i): 1 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}, "logit_bias"),
]


@pytest.mark.parametrize(("dialect", "parse"), DIALECTS, ids=[d for d, _ in DIALECTS])
@pytest.mark.parametrize(("bias", "field"), BAD_BIAS)
def test_bad_logit_bias_is_a_400_naming_it(
    dialect: str, parse: Parse, bias: Any, field: str
) -> None:
    refused(parse, field, logit_bias=bias)


@given(
    st.dictionaries(
        st.text(max_size=12) | st.integers(-5, 2**40).map(str),
        st.floats(allow_nan=True, allow_infinity=True) | st.integers(-200, 200) | st.none(),
        max_size=6,
    )
)
def test_any_logit_bias_is_refused_or_in_bounds(bias: dict[str, Any]) -> None:
    try:
        sp = chat(logit_bias=bias)
    except InvalidRequest as e:
        assert e.param is not None and e.param.startswith("logit_bias")
    else:
        for k, v in sp.logit_bias.items():
            assert 0 <= k <= MAX_TOKEN_ID and -100.0 <= v <= 100.0 and math.isfinite(v)


# ------------------------------------------------------ per-dialect fields


def test_temperature_ceiling_is_the_dialects() -> None:
    assert anthropic(temperature=1).temperature == 1.0
    refused(anthropic, "temperature", temperature=1.5)
    assert chat(temperature=2).temperature == 2.0
    assert responses(temperature=2).temperature == 2.0
    refused(chat, "temperature", temperature=2.5)


def test_chat_logprobs_and_top_logprobs() -> None:
    sp = chat()
    assert (sp.logprobs, sp.top_logprobs) == (False, 0)
    assert (chat(logprobs=None).logprobs, chat(logprobs=False).logprobs) == (False, False)
    assert (chat(logprobs=True).logprobs, chat(logprobs=True).top_logprobs) == (True, 0)
    for k in (0, 1, MAX_TOP_LOGPROBS):
        sp = chat(logprobs=True, top_logprobs=k)
        assert (sp.logprobs, sp.top_logprobs) == (True, k)
    assert chat(logprobs=False, top_logprobs=None).top_logprobs == 0
    for bad in ("true", 1, 0, []):
        refused(chat, "logprobs", logprobs=bad)
    for bad in (-1, MAX_TOP_LOGPROBS + 1, 2.0, "3", True):
        refused(chat, "top_logprobs", logprobs=True, top_logprobs=bad)
    # As OpenAI: top_logprobs needs logprobs=true.
    e = refused(chat, "top_logprobs", top_logprobs=3)
    assert "logprobs" in e.message
    refused(chat, "top_logprobs", logprobs=False, top_logprobs=1)
    assert chat(logprobs=False, top_logprobs=0).top_logprobs == 0  # asks for nothing


def test_responses_include_turns_logprobs_on() -> None:
    inc = ["message.output_text.logprobs"]
    assert responses().logprobs is False
    sp = responses(include=inc, top_logprobs=5)
    assert (sp.logprobs, sp.top_logprobs) == (True, 5)
    assert responses(include=inc).top_logprobs == 0
    # As OpenAI: top_logprobs alone reports nothing; other include values are ignored.
    assert (responses(top_logprobs=5).logprobs, responses(top_logprobs=5).top_logprobs) == (
        False,
        0,
    )
    assert responses(include=["reasoning.encrypted_content"]).logprobs is False
    assert responses(include=None).logprobs is False
    refused(responses, "include", include="message.output_text.logprobs")
    refused(responses, "include[1]", include=["file_search_call.results", 3])
    for bad in (-1, MAX_TOP_LOGPROBS + 1, 1.5, "2"):
        refused(responses, "top_logprobs", include=inc, top_logprobs=bad)
        refused(responses, "top_logprobs", top_logprobs=bad)
    # The Response object echoes the setting (0 when not given, as OpenAI's).
    assert responses_request(include=inc, top_logprobs=3).echo["top_logprobs"] == 3
    assert responses_request().echo["top_logprobs"] == 0


def test_anthropic_has_no_logprobs() -> None:
    sp = anthropic(logprobs=True, top_logprobs=5, include=["message.output_text.logprobs"])
    assert (sp.logprobs, sp.top_logprobs) == (False, 0)  # unknown fields are ignored


def test_all_fields_together_in_every_dialect() -> None:
    extra = {
        "top_k": 20,
        "min_p": 0.1,
        "seed": 9,
        "frequency_penalty": 0.5,
        "presence_penalty": -0.5,
        "repetition_penalty": 1.2,
        "logit_bias": {"3": -5},
        "temperature": 0.7,
        "top_p": 0.9,
    }
    want = SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        min_p=0.1,
        seed=9,
        repetition_penalty=1.2,
        frequency_penalty=0.5,
        presence_penalty=-0.5,
        logit_bias={3: -5.0},
    )
    assert anthropic(**extra) == want
    assert responses(**extra) == want
    want.logprobs, want.top_logprobs = True, 4
    assert chat(**extra, logprobs=True, top_logprobs=4) == want


# ------------------------------------------- through a live server: envelopes


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, Any]]:
    with openai_env() as e:
        yield e


def post(env: dict[str, Any], path: str, body: Any) -> httpx.Response:
    hdrs = {**BEARER, "content-type": "application/json"}
    if path.startswith("/v1/messages"):
        hdrs["anthropic-version"] = "2023-06-01"
    return httpx.post(env["url"] + path, content=json.dumps(body), headers=hdrs, timeout=30)


#: One bad value of each new field: (field named in the error, extra body fields).
WIRE_BAD: list[tuple[str, dict[str, Any]]] = [
    ("frequency_penalty", {"frequency_penalty": 3}),
    ("presence_penalty", {"presence_penalty": -2.5}),
    ("repetition_penalty", {"repetition_penalty": 0}),
    ("min_p", {"min_p": 2}),
    ("top_k", {"top_k": -1}),
    ("logit_bias", {"logit_bias": {"x": 1}}),
    ("logit_bias.9", {"logit_bias": {"9": 500}}),
    ("logit_bias", {"logit_bias": [1]}),
]
CHAT_BAD = [
    *WIRE_BAD,
    ("logprobs", {"logprobs": "yes"}),
    ("top_logprobs", {"top_logprobs": 2}),
    ("top_logprobs", {"logprobs": True, "top_logprobs": 21}),
]
RESPONSES_BAD = [
    *WIRE_BAD,
    ("top_logprobs", {"top_logprobs": -1}),
    ("include", {"include": {"a": 1}}),
]


@pytest.mark.parametrize(
    ("field", "extra"), CHAT_BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(CHAT_BAD)]
)
def test_chat_400_envelope(env: dict[str, Any], field: str, extra: dict[str, Any]) -> None:
    r = post(env, "/v1/chat/completions", {"model": "scripted", "messages": user("x"), **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == field
    assert err["message"].startswith(field)


@pytest.mark.parametrize(
    ("field", "extra"), RESPONSES_BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(RESPONSES_BAD)]
)
def test_responses_400_envelope(env: dict[str, Any], field: str, extra: dict[str, Any]) -> None:
    r = post(env, "/v1/responses", {"model": "scripted", "input": "x", **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == field
    assert err["message"].startswith(field)


@pytest.mark.parametrize(
    ("field", "extra"), WIRE_BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(WIRE_BAD)]
)
def test_anthropic_400_envelope(env: dict[str, Any], field: str, extra: dict[str, Any]) -> None:
    body = {"model": "scripted", "max_tokens": 8, "messages": user("x"), **extra}
    r = post(env, "/v1/messages", body)
    assert r.status_code == 400, r.text
    got = r.json()
    assert got["type"] == "error" and set(got["error"]) == {"type", "message"}
    assert got["error"]["type"] == "invalid_request_error"
    assert got["error"]["message"].startswith(field)


def test_openai_sdk_sees_the_400(env: dict[str, Any]) -> None:
    client: openai.OpenAI = env["client"]
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(
            model="scripted",
            messages=user(say("hi")),
            top_logprobs=3,  # logprobs not set
        )
    assert ei.value.status_code == 400 and ei.value.param == "top_logprobs"  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(
            model="scripted", messages=user(say("hi")), logit_bias={"not-an-id": 5}
        )
    assert ei.value.param == "logit_bias"  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(model="scripted", input="hi", extra_body={"repetition_penalty": -1})
    assert ei.value.param == "repetition_penalty"  # type: ignore[attr-defined]

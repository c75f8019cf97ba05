"""The sampling fields of every dialect: one reader, one rule per field (STYLE #13).

Which dialect reads which field (absent or ``null``: the engine's default)::

    field               Anthropic      Chat Completions         Responses
    temperature         0..1           0..2                     0..2
    top_p               (0, 1]         (0, 1]                   (0, 1]
    top_k               0..2^31-1      extra (vLLM)             extra
    min_p               extra          extra (vLLM)             extra
    seed                extra          64-bit integer           extra
    frequency_penalty   extra          -2..2                    extra
    presence_penalty    extra          -2..2                    extra
    repetition_penalty  extra          extra (vLLM): (0, 10]    extra
    logit_bias          extra          {"<token id>": -100..100, at most 1024}
    logprobs            -              boolean                  include: [...]
    top_logprobs        -              0..20, needs logprobs    0..20

"extra" marks a field that API's own reference does not have: it is read from
the top level of the body (where an SDK's ``extra_body`` puts it) with the
same rule as where it is native. Every failure is a 400 naming the field; the
bounds are the ones the engine checks, read from one table
(:data:`mlx_cairn.types.SAMPLING_BOUNDS`). Token ids in
``logit_bias`` are checked against the model's vocabulary by the engine
(``Engine.prepare``), still before any model work.

Example::

    sp = read_sampling({"temperature": 0, "logit_bias": {"42": 5}}, max_temperature=2.0)
    assert sp.temperature == 0.0 and sp.logit_bias == {42: 5.0}
"""

from __future__ import annotations

import re
from typing import Any

from mlx_cairn.protocol.codec import fail, is_int, is_num, short
from mlx_cairn.types import MAX_LOGIT_BIAS_ENTRIES, SAMPLING_BOUNDS, SamplingParams

#: Largest token id a ``logit_bias`` key may spell (ids are int32 in the
#: sampler); whether the model's vocabulary has it is the engine's check.
MAX_TOKEN_ID = 2**31 - 1
#: A ``logit_bias`` key: ASCII digits only (no sign, no spaces, no exponent).
_TOKEN_ID = re.compile(r"[0-9]{1,10}")


def number(
    body: dict[str, Any], key: str, lo: float, hi: float, *, above_lo: bool = False
) -> float | None:
    """``body[key]`` as a float in ``[lo, hi]`` (``(lo, hi]`` with ``above_lo``); None if absent."""
    v = body.get(key)
    if v is None:
        return None
    if not is_num(v) or not lo <= v <= hi:
        raise fail(key, f"must be a number between {lo:g} and {hi:g}")
    if above_lo and v == lo:
        raise fail(key, f"must be greater than {lo:g}")
    return float(v)


def integer(body: dict[str, Any], key: str, lo: int, hi: int, what: str = "") -> int | None:
    """``body[key]`` as an int in ``[lo, hi]``; None if absent."""
    v = body.get(key)
    if v is None:
        return None
    if not is_int(v) or not lo <= v <= hi:
        raise fail(key, what or f"must be an integer between {lo} and {hi}")
    return int(v)


def bounded(
    body: dict[str, Any], key: str, setting: str | None = None, *, hi: float | None = None
) -> Any:
    """``body[key]`` checked against ``SAMPLING_BOUNDS[setting or key]`` (``hi`` lowers
    the ceiling: a dialect's own); an int for an integer setting, else a float; None
    if absent."""
    b = SAMPLING_BOUNDS[setting or key]
    top = b.hi if hi is None else min(b.hi, hi)
    if b.integer:
        return integer(body, key, int(b.lo), int(top), f"must be {b.what}" if b.what else "")
    return number(body, key, b.lo, top, above_lo=b.lo_open)


def logit_bias(raw: Any, param: str = "logit_bias") -> dict[int, float]:
    """``logit_bias``: an object of token id strings to numbers in -100..100."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise fail(param, "must be an object mapping token ids to numbers")
    if len(raw) > MAX_LOGIT_BIAS_ENTRIES:
        raise fail(param, f"at most {MAX_LOGIT_BIAS_ENTRIES} entries")
    out: dict[int, float] = {}
    for k, v in raw.items():
        if not isinstance(k, str) or not _TOKEN_ID.fullmatch(k) or int(k) > MAX_TOKEN_ID:
            raise fail(param, f"key {short(k)} is not a token id (a non-negative integer)")
        b = SAMPLING_BOUNDS["logit_bias"]
        if not is_num(v) or not b.lo <= v <= b.hi:
            raise fail(f"{param}.{k}", f"must be a number between {b.lo:g} and {b.hi:g}")
        out[int(k)] = float(v)
    return out


def top_logprobs(body: dict[str, Any]) -> int | None:
    """``top_logprobs``: how many alternatives to report per token (0..20); None if absent."""
    n: int | None = bounded(body, "top_logprobs")
    return n


def read_sampling(body: dict[str, Any], *, max_temperature: float) -> SamplingParams:
    """Every sampling field of the table above but the logprobs ones (the dialect's part).

    ``max_temperature`` is the dialect's ceiling (Anthropic 1, OpenAI 2).
    """
    sp = SamplingParams()
    for key in SETTINGS:
        v = bounded(body, key, hi=max_temperature if key == "temperature" else None)
        if v is not None:
            setattr(sp, key, v)
    sp.logit_bias = logit_bias(body.get("logit_bias"))
    return sp


#: The settings :func:`read_sampling` reads, in the order a refusal names the first bad one.
SETTINGS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)

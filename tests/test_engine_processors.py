"""Logits processors and logprobs: the batched engine against the plain one-row reference."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.engine.reference import prefill
from mlx_cairn.errors import InvalidRequest
from mlx_cairn.models.cache import ContiguousKVCache
from mlx_cairn.testing.engine_checks import assert_at_rest, reference_ids, submit_together
from mlx_cairn.testing.tiny_models import tiny_model
from mlx_cairn.types import ChatRequest, Done, Message, SamplingParams, TokenLogprob

TIMEOUT = 60.0


@pytest.fixture(scope="module")
def lm():
    return tiny_model("llama", seed=5)


@pytest.fixture(scope="module")
def engine(lm):
    e = Engine(lm, EngineConfig(num_blocks=128, block_size=4, max_batch=8))
    yield e
    e.close()


def req(text: str, max_tokens: int = 12, **sampling) -> ChatRequest:
    sampling.setdefault("temperature", 0.0)
    return ChatRequest(
        [Message("user", text)], max_tokens=max_tokens, sampling=SamplingParams(**sampling)
    )


def run(engine, request):
    stream = engine.submit(request)
    events = list(stream.iter_sync(TIMEOUT))
    assert isinstance(events[-1], Done), events[-1]
    return stream, events


SETTINGS = [
    {},
    {"repetition_penalty": 1.8},
    {"frequency_penalty": 1.5},
    {"presence_penalty": -1.2},
    {"frequency_penalty": 0.7, "presence_penalty": 0.9, "repetition_penalty": 1.3},
    {"logit_bias": {11: 6.0, 12: -100.0, 40: 3.5}},
    {"temperature": 0.9, "seed": 7, "frequency_penalty": 2.0},
    {"temperature": 1.0, "seed": 3, "repetition_penalty": 0.6, "logit_bias": {20: 4.0}},
]


def test_batched_processors_equal_the_plain_reference(lm, engine):
    """Eight rows with different processors decode together; each equals its one-row reference."""
    prompts = ["a b c a b c", "Hello there", "x " * 9, "one two", "repeat repeat", "zz", "q", "k k"]
    requests = [req(p, 14, **s) for p, s in zip(prompts, SETTINGS, strict=True)]
    prepared = [engine.prepare(r) for r in requests]
    streams = submit_together(engine, prepared)  # they share steps
    for p, s in zip(prepared, streams, strict=True):
        events = list(s.iter_sync(TIMEOUT))
        assert isinstance(events[-1], Done), events[-1]
        want = reference_ids(lm, p.prompt_ids, p.max_tokens, p.sampling)
        assert s.output_ids == want[: len(s.output_ids)] and len(s.output_ids) == len(want)
    assert_at_rest(engine)


def test_penalties_change_the_output(lm, engine):
    """The processors do something: a strong frequency penalty breaks greedy repetition."""
    plain, _ = run(engine, req("a a a a", 24))
    pen, _ = run(engine, req("a a a a", 24, frequency_penalty=2.0, presence_penalty=2.0))
    assert plain.output_ids != pen.output_ids
    counts = np.bincount(pen.output_ids)
    assert counts.max() < np.bincount(plain.output_ids).max() or len(set(plain.output_ids)) > 1


def test_logit_bias_of_100_forces_the_token(lm, engine):
    eos = set(lm.eos_token_ids)
    tok = next(t for t in range(30, 200) if t not in eos)
    for sampling in ({"temperature": 0.0}, {"temperature": 1.5, "seed": 11, "top_p": 0.9}):
        s, _ = run(engine, req("anything at all", 10, logit_bias={tok: 100.0}, **sampling))
        assert s.output_ids == [tok] * 10


def test_logit_bias_outside_the_vocabulary_is_refused(lm, engine):
    vocab = int(lm.model.vocab_size)
    with pytest.raises(InvalidRequest) as e:
        engine.prepare(req("hi", logit_bias={vocab: 1.0}))
    assert e.value.param == "logit_bias" and str(vocab) in str(e.value)
    for bad in ({-1: 1.0}, {5: 101.0}, {5: float("nan")}):
        with pytest.raises(InvalidRequest):
            engine.prepare(req("hi", logit_bias=bad))
    with pytest.raises(InvalidRequest):
        engine.prepare(req("hi", frequency_penalty=2.5))
    with pytest.raises(InvalidRequest):
        engine.prepare(req("hi", repetition_penalty=0.0))
    with pytest.raises(InvalidRequest):
        engine.prepare(req("hi", top_logprobs=21))


def _raw_logprobs(lm, prompt: list[int], output: list[int]) -> list[np.ndarray]:
    """log_softmax of the raw logits before each output token (a separate plain forward pass)."""
    out = []
    for i in range(len(output)):
        cache = ContiguousKVCache(lm.model.num_layers)
        logits = prefill(lm.model, cache, prompt + output[:i]).astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        out.append(np.array(lp[0]))
    return out


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 5}])
def test_logprobs_are_the_raw_distribution(lm, engine, sampling):
    request = req("What is two plus two?", 6, logprobs=True, top_logprobs=5, **sampling)
    prepared = engine.prepare(request)
    stream, events = run(engine, prepared)
    lps = [e for e in events if isinstance(e, TokenLogprob)]
    out = stream.output_ids
    eos = set(lm.eos_token_ids)
    assert [e.token_id for e in lps] == [t for t in out if t not in eos]
    ref = _raw_logprobs(lm, prepared.prompt_ids, out)
    for e, row in zip(lps, ref, strict=False):
        assert e.logprob <= 0.0
        assert e.logprob == pytest.approx(float(row[e.token_id]), abs=1e-4)
        assert len(e.top) == 5
        values = [t.logprob for t in e.top]
        assert values == sorted(values, reverse=True) and all(v <= 0.0 for v in values)
        best = np.argsort(-row)[:5]
        assert [t.token_id for t in e.top][:2] == [int(b) for b in best][:2]
        for t in e.top:
            assert t.logprob == pytest.approx(float(row[t.token_id]), abs=1e-4)
        if sampling["temperature"] == 0.0:
            assert e.top[0].token_id == e.token_id
        assert bytes(e.token_bytes).decode("utf-8", "replace") == e.token or "\ufffd" in e.token


def test_events_without_logprobs_have_none(engine):
    _, events = run(engine, req("hello", 4))
    assert not any(isinstance(e, TokenLogprob) for e in events)


class Successor:
    """A row mask that needs the previous token on the host: only ``prev + 1`` may follow."""

    needs_host_token = True

    def __init__(self, first: int) -> None:
        self.first = first
        self.calls = 0

    def mask(self, seq, vocab: int):
        assert not seq.inflight, "a host-token row was planned with a placeholder"
        self.calls += 1
        out = seq.tokens[seq.num_prompt :]
        want = out[-1] + 1 if out else self.first
        return mx.where(mx.arange(vocab) == want, 0.0, -mx.inf).astype(mx.float32)


def test_a_host_token_mask_sees_every_token_and_the_forward_still_runs_ahead(lm, engine):
    """The grammar seam: a mask row's forward pass is planned on the placeholder
    token like any row's, and its mask is computed only once that token is on the
    host (the mask asserts it); plain rows in the same steps are unaffected."""
    placeholders: dict[int, int] = {}
    real = engine._runner.execute

    def execute(plan):
        for r in plan.rows:
            placeholders[r.seq.request_id] = placeholders.get(r.seq.request_id, 0) + r.placeholder
        return real(plan)

    engine._runner.execute = execute
    try:
        masked = engine.prepare(req("count with me", 8))
        plain = engine.prepare(req("and me too", 8))
        mask = Successor(first=40)
        with engine._lock:
            s_masked = engine.submit(masked)
            engine._inbox[-1].row_masks.append(mask)
            s_plain = engine.submit(plain)
        for s in (s_masked, s_plain):
            assert isinstance(list(s.iter_sync(TIMEOUT))[-1], Done)
    finally:
        engine._runner.execute = real
    assert s_masked.output_ids == list(range(40, 48))
    assert mask.calls == 8
    assert placeholders[s_masked.request_id] > 0
    assert placeholders[s_plain.request_id] > 0
    assert s_plain.output_ids == reference_ids(lm, plain.prompt_ids, 8, plain.sampling)
    assert_at_rest(engine)


def test_logprobs_stay_raw_under_processors(lm, engine):
    """A +100 bias picks the token; its reported logprob is still the model's own."""
    eos = set(lm.eos_token_ids)
    tok = next(t for t in range(60, 200) if t not in eos)
    request = req("bias me", 4, logprobs=True, top_logprobs=2, logit_bias={tok: 100.0})
    prepared = engine.prepare(request)
    stream, events = run(engine, prepared)
    assert stream.output_ids == [tok] * 4
    ref = _raw_logprobs(lm, prepared.prompt_ids, stream.output_ids)
    lps = [e for e in events if isinstance(e, TokenLogprob)]
    assert len(lps) == 4
    for e, row in zip(lps, ref, strict=True):
        assert e.logprob == pytest.approx(float(row[tok]), abs=1e-4) and e.logprob < -0.01

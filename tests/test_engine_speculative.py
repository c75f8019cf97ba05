"""Speculative decoding (engine/speculate.py): exact, batched, rolled back, and harmless."""

from __future__ import annotations

import dataclasses
import math

import mlx.core as mx
import numpy as np
import pytest

from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.engine.speculate import NgramProposer, RowSpec, VerifyRow, verify
from mlx_cairn.testing.engine_checks import (
    assert_at_rest,
    greedy_reference,
    greedy_reference_at,
    submit_together,
)
from mlx_cairn.testing.tiny_models import tiny_model
from mlx_cairn.types import Admitted, ChatRequest, Done, Error, Message, SamplingParams

TIMEOUT = 60.0
#: Prompts with repeated text, so prompt lookup has something to propose.
PROMPTS = [
    "one two three four five six seven eight nine ten. one two three four five six",
    "def add(x, y):\n    return x + y\n\ndef add(x, y):\n    return x + y\n\ndef add(",
    "abc abc abc abc abc abc abc abc abc abc abc abc",
    "Hi there",
    "the cat sat on the mat; the cat sat on the mat; the cat sat on",
]


# ---------------------------------------------------------------- proposals


def test_ngram_proposes_what_followed_the_longest_latest_match():
    p = NgramProposer()
    #        0  1  2  3  4  5  6  7  8  9
    toks = [5, 6, 7, 8, 9, 1, 6, 7, 2, 6, 7]
    # The end (6 7) occurs at 1-2 (then 8 9) and 6-7 (then 2): the latest wins.
    assert p.propose(toks, 3) == [2, 6, 7]
    # A longer match beats a later one: (5 6 7) only occurs at 0-2.
    assert p.propose([*toks, 3, 5, 6, 7], 2) == [8, 9]
    assert p.propose([1, 2, 3, 4], 4) == []  # no earlier occurrence
    assert p.propose([1, 2, 9, 2], 4) == []  # a one-token match is too short
    assert p.propose(toks, 0) == []


def test_ngram_grows_with_the_sequence():
    p = NgramProposer()
    toks = list(range(300))
    assert p.propose(toks, 4) == []
    toks += [10, 11, 12]  # past the first buffer size
    assert p.propose(toks, 4) == [13, 14, 15, 16]


def test_row_spec_pauses_after_misses_and_resumes():
    spec = RowSpec(8)
    toks = [1, 2, 3, 1, 2]
    assert spec.propose(toks, 8) == [3, 1, 2]
    spec.record(3, 0)
    assert spec.k == 1
    spec.record(1, 0)  # two misses in a row: a pause
    assert spec.propose(toks, 8) == [] and not spec.wants
    spec.observe(toks, 100)  # the pause is over after enough tokens
    assert spec.wants and spec.propose(toks, 8) == [3]
    spec.record(1, 1)
    assert spec.k == 8  # everything accepted: K goes back up
    assert (spec.proposed, spec.accepted, spec.verifies) == (5, 1, 3)


# ---------------------------------------------------------------- verification


def _logits(rows: list[list[int]], vocab: int = 6) -> mx.array:
    """Logits whose argmax at each position is the given token."""
    out = np.zeros((sum(len(r) for r in rows), vocab), dtype=np.float32)
    i = 0
    for r in rows:
        for t in r:
            out[i, t] = 5.0
            i += 1
    return mx.array(out)


def test_greedy_verify_accepts_the_leading_agreement_then_one_more():
    greedy = SamplingParams(temperature=0.0)
    # Row 0: argmax 1 2 3 4 against draft 1 2 5 -> accept 2, then the correction 3.
    # Row 1: argmax 4 0 against draft 4 -> all accepted, then the bonus 0.
    # Row 2: argmax 2 3 against draft 1 -> nothing accepted, the model's 2.
    argmax = [[1, 2, 3, 4], [4, 0], [2, 3]]
    rows = [
        VerifyRow(0, (1, 2, 5), greedy, 0),
        VerifyRow(4, (4,), greedy, 0),
        VerifyRow(6, (1,), greedy, 0),
    ]
    tokens, counts = verify(_logits(argmax), rows)
    counts_l = counts.tolist()
    toks = tokens.tolist()
    got = [toks[b][: counts_l[b] + 1] for b in range(3)]
    assert got == [[1, 2, 3], [4, 0], [2]]


def _chi_square_p(observed: np.ndarray, expected: np.ndarray) -> float:
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a token outside the distribution was sampled"
    stat = float((((observed - expected) ** 2)[keep] / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    # Wilson-Hilferty: the chi-square tail through a normal approximation.
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=3),
        SamplingParams(temperature=1.3, top_p=0.8),
    ],
    ids=["t1", "topk", "topp"],
)
@pytest.mark.parametrize("draft", [0, 4], ids=["likely-draft", "unlikely-draft"])
def test_speculative_sampling_keeps_the_distribution(params, draft):
    """First output token of a verify row, over many seeds: distributed as the
    model's filtered distribution, whatever the draft proposes."""
    from mlx_cairn.engine.sampler import filtered_probs

    base = np.array([2.0, 1.5, 1.0, 0.2, -0.5, -1.0], dtype=np.float32)
    n = 4000
    rows = [VerifyRow(2 * i, (draft,), dataclasses.replace(params, seed=i), 3) for i in range(n)]
    logits = mx.array(np.tile(base, (2 * n, 1)))
    tokens, _ = verify(logits, rows)
    first = np.array(tokens[:, 0].tolist())
    observed = np.bincount(first, minlength=base.size).astype(np.float64)
    probs = np.array(filtered_probs(mx.array(base[None, :]), [params])[0].tolist())
    p = _chi_square_p(observed, probs * n)
    assert p > 1e-3, (observed, probs * n, p)


# ---------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def lm():
    return tiny_model("llama", seed=1)


@pytest.fixture(scope="module", params=["ngram", "draft"])
def spec(request):
    """The engine's speculation: prompt lookup, or a draft model that agrees with the
    model often but not always (its weights with noise)."""
    if request.param == "ngram":
        return {"speculative": "ngram"}
    return {"draft_model": tiny_model("llama", seed=1, noise=0.05)}


def greedy(text: str, max_tokens: int = 32, **kw) -> ChatRequest:
    return ChatRequest(
        [Message("user", text)], max_tokens=max_tokens, sampling=SamplingParams(0.0), **kw
    )


def run_all(engine: Engine, reqs: list[ChatRequest]) -> list[list]:
    streams = [engine.submit(r) for r in reqs]
    out = [list(s.iter_sync(timeout=TIMEOUT)) for s in streams]
    for events in out:
        assert isinstance(events[-1], Done), events[-1]
    return out


def body(events: list) -> list:
    """The events a client reads as output (not the admission, not the final Done)."""
    return [e for e in events if not isinstance(e, (Admitted, Done))]


def done(events: list) -> Done:
    last = events[-1]
    assert isinstance(last, Done), last
    return last


def test_greedy_output_is_unchanged_batched_and_alone(lm, spec):
    reqs = [greedy(p, 40) for p in PROMPTS]
    with Engine(lm, EngineConfig(**spec, max_batch=8)) as eng:
        batched = run_all(eng, reqs)
        alone = [run_all(eng, [r])[0] for r in reqs]
        for r, b, a in zip(reqs, batched, alone, strict=True):
            ref = greedy_reference(lm, eng.prepare(r).prompt_ids, r.max_tokens)
            assert done(b).usage.output_tokens == len(ref)
            assert body(b) == body(a)
        proposed = sum(done(b).usage.draft_tokens for b in batched + alone)
        accepted = sum(done(b).usage.accepted_draft_tokens for b in batched + alone)
        assert proposed > 0 and 0 < accepted <= proposed
        st = assert_at_rest(eng)
        assert st.spec_draft_tokens == proposed and st.spec_accepted_tokens == accepted


def test_output_ids_match_the_reference_token_for_token(lm, spec):
    with Engine(lm, EngineConfig(**spec, max_batch=4)) as eng:
        streams = [eng.submit(greedy(p, 40)) for p in PROMPTS]
        for s, p in zip(streams, PROMPTS, strict=True):
            list(s.iter_sync(timeout=TIMEOUT))
            ref = greedy_reference(lm, eng.prepare(greedy(p, 40)).prompt_ids, 40)
            assert s.output_ids == ref
        assert_at_rest(eng)


def test_events_equal_without_speculation_with_stops_and_lengths(lm, spec):
    """Stop sequences and max_tokens cut an accepted run where decoding alone would."""
    reqs = []
    for p in PROMPTS:
        plain = run_all(Engine(lm), [greedy(p, 40)])[0]
        text = "".join(getattr(e, "text", "") for e in plain)
        stop = [text[len(text) // 2 : len(text) // 2 + 3]] if len(text) > 8 else []
        for n in (1, 7, 40):
            reqs.append(greedy(p, n, stop=stop))
    with Engine(lm) as plain_eng, Engine(lm, EngineConfig(**spec, max_batch=8)) as spec_eng:
        want = run_all(plain_eng, reqs)
        got = run_all(spec_eng, reqs)
        for w, g in zip(want, got, strict=True):
            assert body(g) == body(w)
            dw, dg = done(w), done(g)
            assert (dg.stop_reason, dg.matched_stop) == (dw.stop_reason, dw.matched_stop)
            assert dg.usage.output_tokens == dw.usage.output_tokens
        assert_at_rest(spec_eng)


def test_rejected_positions_never_enter_the_prefix_cache(lm, spec):
    """The next turn holds the whole first answer: its prefix hit reuses only blocks of
    accepted tokens (a rejected draft's KV in a cached block would change its output)."""
    with Engine(lm, EngineConfig(**spec, block_size=4)) as eng:
        for p in PROMPTS:
            first = eng.submit(greedy(p, 40))
            list(first.iter_sync(timeout=TIMEOUT))
            answer = lm.tokenizer.decode(first.output_ids)
            follow = ChatRequest(
                [Message("user", p), Message("assistant", answer), Message("user", p)],
                max_tokens=24,
                sampling=SamplingParams(0.0),
            )
            s = eng.submit(follow)
            events = list(s.iter_sync(timeout=TIMEOUT))
            ids = eng.prepare(follow).prompt_ids
            assert s.output_ids == greedy_reference(lm, ids, 24)
            assert done(events).usage.cached_tokens > 0
        assert_at_rest(eng)


@pytest.mark.parametrize("kv", [None, 8], ids=["full", "kv8"])
def test_preemption_under_a_small_pool_keeps_outputs_exact(lm, spec, kv):
    kw: dict = {}
    if kv:
        # Verification over 8-bit blocks (issue 39): the qwen3 (head_dim 32, one
        # quantization group) and its noisy draft; the reference is a roomy engine
        # at the same settings, one request at a time.
        kw = {"kv_bits": 8, "kv_group_size": 32}
        lm = tiny_model("qwen3", seed=1)
        if "draft_model" in spec:
            spec = {"draft_model": tiny_model("qwen3", seed=1, noise=0.05)}
    reqs = [greedy(p, 40) for p in PROMPTS] * 2
    # No decode share: rows side by side (the share may let one finish first).
    config = EngineConfig(**spec, **kw, num_blocks=40, block_size=4, max_batch=8, decode_share=0)
    with Engine(lm, config) as eng:
        streams = submit_together(eng, reqs)  # they meet in the pool
        for s, r in zip(streams, reqs, strict=True):
            list(s.iter_sync(timeout=TIMEOUT))
            assert s.output_ids == greedy_reference_at(lm, eng.prepare(r).prompt_ids, 40, **kw)
        st = assert_at_rest(eng)
        assert st.spec_draft_tokens > 0 and st.preemptions > 0


def test_opt_out_and_ineligible_rows_do_not_speculate(lm, spec):
    with Engine(lm, EngineConfig(**spec)) as eng:
        off = done(run_all(eng, [greedy(PROMPTS[2], 32, speculative=False)])[0])
        penalized = ChatRequest(
            [Message("user", PROMPTS[2])],
            max_tokens=32,
            sampling=SamplingParams(0.0, repetition_penalty=1.2),
        )
        pen = done(run_all(eng, [penalized])[0])
        on = done(run_all(eng, [greedy(PROMPTS[2], 32)])[0])
        assert off.usage.draft_tokens == 0 and pen.usage.draft_tokens == 0
        assert on.usage.draft_tokens > 0
    with Engine(lm) as eng:  # the server's setting: off
        assert done(run_all(eng, [greedy(PROMPTS[2], 32)])[0]).usage.draft_tokens == 0


def test_sampled_rows_speculate_and_stay_seeded(lm, spec):
    """A sampled row's output depends on its seed, not on the batch around it."""
    req = ChatRequest(
        [Message("user", PROMPTS[2])],
        max_tokens=32,
        sampling=SamplingParams(temperature=0.8, seed=7),
    )
    with Engine(lm, EngineConfig(**spec, max_batch=8)) as eng:
        alone = eng.submit(req)
        list(alone.iter_sync(timeout=TIMEOUT))
        streams = [eng.submit(req if i == 2 else greedy(p, 32)) for i, p in enumerate(PROMPTS)]
        for s in streams:
            list(s.iter_sync(timeout=TIMEOUT))
        assert streams[2].output_ids == alone.output_ids
        assert_at_rest(eng)


def test_a_fault_in_a_verify_row_fails_that_request_only(lm, spec):
    with Engine(lm, EngineConfig(**spec, max_batch=8)) as eng:
        victim: list[int] = []

        def hook(phase, seq):
            if phase == "finalize" and seq.verifying and not victim:
                victim.append(seq.request_id)
            if phase == "finalize" and seq.request_id in victim:
                raise RuntimeError("injected")  # every read of that row fails

        eng._row_fault_hook = hook
        streams = [eng.submit(greedy(p, 40)) for p in PROMPTS]
        for s, p in zip(streams, PROMPTS, strict=True):
            events = list(s.iter_sync(timeout=TIMEOUT))
            if s.request_id in victim:
                assert isinstance(events[-1], Error) and events[-1].kind == "internal"
            else:
                ids = eng.prepare(greedy(p, 40)).prompt_ids
                assert s.output_ids == greedy_reference(lm, ids, 40)
        assert victim
        assert_at_rest(eng)


def test_a_lost_verify_step_is_recomputed(lm, spec):
    """A step that fails on the device loses its verify rows' drafts: the rows feed
    their last known token again and finish with the reference output."""
    with Engine(lm, EngineConfig(**spec, max_batch=8)) as eng:
        runner = eng._runner
        real = runner.read
        failed: list[bool] = []

        def read(out):
            if out.verify and not failed:
                failed.append(True)
                raise RuntimeError("injected device failure")
            return real(out)

        runner.read = read  # type: ignore[method-assign]
        s = eng.submit(greedy(PROMPTS[2], 40))
        events = list(s.iter_sync(timeout=TIMEOUT))
        assert failed
        # The step's requests fail with it (as for any lost step); the engine goes on.
        assert isinstance(events[-1], (Done, Error))
        again = eng.submit(greedy(PROMPTS[2], 40))
        list(again.iter_sync(timeout=TIMEOUT))
        ids = eng.prepare(greedy(PROMPTS[2], 40)).prompt_ids
        assert again.output_ids == greedy_reference(lm, ids, 40)
        assert_at_rest(eng)


def test_bad_settings_are_refused(lm, spec):
    with pytest.raises(ValueError, match="speculative"):
        Engine(lm, EngineConfig(speculative="medusa"))
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        Engine(lm, EngineConfig(**spec, num_speculative_tokens=-1))


def test_a_draft_model_that_always_agrees_has_every_draft_accepted(lm):
    with Engine(lm, EngineConfig(draft_model=tiny_model("llama", seed=1), max_batch=4)) as eng:
        for d in [done(e) for e in run_all(eng, [greedy(p, 32) for p in PROMPTS])]:
            assert d.usage.draft_tokens > 0
            assert d.usage.accepted_draft_tokens == d.usage.draft_tokens
        assert_at_rest(eng)


def test_a_draft_model_that_never_agrees_changes_nothing(lm):
    with Engine(lm, EngineConfig(draft_model=tiny_model("llama", seed=2), max_batch=4)) as eng:
        streams = [eng.submit(greedy(p, 32)) for p in PROMPTS]
        for s, p in zip(streams, PROMPTS, strict=True):
            list(s.iter_sync(timeout=TIMEOUT))
            assert s.output_ids == greedy_reference(lm, eng.prepare(greedy(p, 32)).prompt_ids, 32)
        assert_at_rest(eng)


@pytest.mark.slow
def test_a_draft_model_must_share_the_vocabulary(lm, default_model):
    with pytest.raises(ValueError, match="same tokenizer"):
        Engine(lm, EngineConfig(draft_model=default_model))
    with pytest.raises(ValueError, match="pick one"):
        Engine(lm, EngineConfig(speculative="ngram", draft_model=lm))

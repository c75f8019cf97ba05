"""Hybrid architectures (recurrent-state layers between attention layers) on the engine.

For each hybrid mlx-lm architecture a tiny random-weight model is built from
mlx-lm's own classes (testing/tiny_configs.py ``HYBRID_CONFIGS``). The engine
runs prompts of different lengths batched together, chunked, one of them a
prefix hit restored from a state snapshot; every row's greedy tokens must
equal mlx-lm's own single-sequence generation (its ``ArraysCache`` /
``KVCache``). Then the prefix cache: P, then P + suffix, must report >= 90%
of P cached and give exactly the cold output; and the next turn that
re-sends prompt + answer hits past the answer.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.testing.engine_checks import closing_at_rest, greedy_base
from mlx_cairn.testing.tiny_configs import HYBRID_CONFIGS
from mlx_cairn.testing.tiny_models import mlx_lm_greedy, tiny_zoo_model
from mlx_cairn.types import ChatRequest, Done, Message, SamplingParams

TIMEOUT = 120.0
MAX_TOKENS = 8
HYBRIDS = sorted(HYBRID_CONFIGS)


def ids(rng: np.random.Generator, n: int) -> list[int]:
    return [int(x) for x in rng.integers(3, 360, size=n)]


def base_request(engine: Engine, max_tokens: int = MAX_TOKENS):
    return greedy_base(engine, max_tokens)


def run(engine: Engine, base, prompt: list[int]):
    # (The base request's last-user-message position means nothing for these ids.)
    return engine.submit(dataclasses.replace(base, prompt_ids=prompt, last_user_at=None))


def finish(stream) -> Done:
    events = list(stream.iter_sync(timeout=TIMEOUT))
    assert isinstance(events[-1], Done), events[-1]
    return events[-1]


@pytest.fixture(scope="module", params=HYBRIDS)
def hybrid(request):
    lm = tiny_zoo_model(request.param, seed=1)
    assert any(s.state for s in lm.model.layer_specs), "not a hybrid"
    return lm


def test_batched_greedy_equals_mlx_lm(hybrid):
    inner = hybrid.model.inner
    eos = set(hybrid.eos_token_ids)
    rng = np.random.default_rng(7)
    long = ids(rng, 37)
    ps = {
        "long": long,
        "short": ids(rng, 5),
        "mid": ids(rng, 19),
        "prefix": long[:30] + ids(rng, 7),  # a hit up to long's snapshot at 36 // 4 blocks
        "longer": ids(rng, 52),
    }
    want = {k: mlx_lm_greedy(inner, v, MAX_TOKENS, eos) for k, v in ps.items()}
    assert len({t for v in want.values() for t in v}) > 3, want
    engine = Engine(
        hybrid,
        EngineConfig(num_blocks=128, block_size=4, step_token_budget=16, snapshot_interval=4),
    )
    with closing_at_rest(engine):
        base = base_request(engine)
        first = run(engine, base, ps["long"])
        assert finish(first).usage.cached_tokens == 0
        got = {"long": first.output_ids}
        names = ["short", "mid", "prefix", "longer"]
        streams = [run(engine, base, ps[k]) for k in names]
        dones = dict(zip(names, (finish(s) for s in streams), strict=True))
        for k, s in zip(names, streams, strict=True):
            got[k] = s.output_ids
        # "prefix" shares 7 full blocks with "long"; long's interval snapshot
        # (every 4 blocks here) covers 4 of them.
        assert dones["prefix"].usage.cached_tokens == 16
        st = engine.stats()
        assert st.state_snapshot_hits >= 1 and st.state_snapshots >= 1
    assert got == want


def test_prefix_hit_equals_cold_and_next_turn_hits(hybrid):
    prefix_hit_equals_cold_and_next_turn_hits(hybrid)


def test_prefix_hit_equals_cold_on_8_bit_kv_blocks():
    """The same over 8-bit KV blocks (issue 39): the attention layers' KV is packed,
    the recurrent state and its snapshots stay full precision."""
    hybrid = tiny_zoo_model("qwen3_next", seed=1, head_dim=64)
    prefix_hit_equals_cold_and_next_turn_hits(hybrid, kv_bits=8)


def prefix_hit_equals_cold_and_next_turn_hits(hybrid, **kv) -> None:
    rng = np.random.default_rng(3)
    p = ids(rng, 61)
    suffix = ids(rng, 6)
    cold_engine = Engine(
        hybrid, EngineConfig(num_blocks=96, block_size=4, step_token_budget=24, **kv)
    )
    with closing_at_rest(cold_engine):
        base = base_request(cold_engine)
        cold = run(cold_engine, base, p + suffix)
        assert finish(cold).usage.cached_tokens == 0
    engine = Engine(hybrid, EngineConfig(num_blocks=96, block_size=4, step_token_budget=24, **kv))
    with closing_at_rest(engine):
        base = base_request(engine)
        first = run(engine, base, p)
        finish(first)
        second = run(engine, base, p + suffix)
        done = finish(second)
        assert done.usage.cached_tokens >= 0.9 * len(p), done.usage
        assert second.output_ids == cold.output_ids
        # The next turn re-sends prompt + answer: the snapshot taken at the end
        # of the request covers its last full block.
        turn = p + suffix + second.output_ids + ids(rng, 5)
        want_cached = (len(p + suffix) + MAX_TOKENS - 1) // 4 * 4
        third = run(engine, base, turn)
        assert finish(third).usage.cached_tokens >= want_cached
        st = engine.stats()
        assert st.state_snapshot_bytes > 0 and st.kv_bits == kv.get("kv_bits", 0)


def test_preemption_and_cancel_leave_nothing(hybrid):
    """A pool too small for every row preempts; recomputed rows still match mlx-lm."""
    inner = hybrid.model.inner
    eos = set(hybrid.eos_token_ids)
    rng = np.random.default_rng(11)
    ps = [ids(rng, n) for n in (23, 29, 17, 31)]
    want = [mlx_lm_greedy(inner, v, MAX_TOKENS, eos) for v in ps]
    engine = Engine(
        hybrid, EngineConfig(num_blocks=24, block_size=4, step_token_budget=16, max_batch=4)
    )
    with closing_at_rest(engine):
        base = base_request(engine)
        doomed = run(engine, base, ids(rng, 19))
        streams = [run(engine, base, v) for v in ps]
        doomed.cancel()
        for s in streams:
            finish(s)
        assert [s.output_ids for s in streams] == want


def test_forced_reasoning_close_recomputes_the_state(hybrid):
    """The reasoning budget forces the close tag in place of a sampled token: the
    state takes exactly the forced text, and the answer equals mlx-lm's
    continuation of it."""
    inner = hybrid.model.inner
    eos = set(hybrid.eos_token_ids)
    rng = np.random.default_rng(5)
    p = ids(rng, 21)
    close = [301, 302]
    budget = 3
    free = mlx_lm_greedy(inner, p, budget, eos)
    assert not set(free) & set(close) and len(free) == budget
    rest = mlx_lm_greedy(inner, p + free + close, 6, eos)
    engine = Engine(hybrid, EngineConfig(num_blocks=128, block_size=4, step_token_budget=16))
    with closing_at_rest(engine):
        prep = dataclasses.replace(
            base_request(engine, max_tokens=budget + len(close) + 6),
            prompt_ids=p,
            reasoning_budget=budget,
            reasoning_tags=([300], close),
            in_reasoning=True,
        )
        s = engine.submit(prep)
        finish(s)
    assert s.output_ids[: budget + len(close)] == free + close
    assert s.output_ids[budget + len(close) :] == rest[: len(s.output_ids) - budget - len(close)]


def test_a_lost_step_recomputes_the_state(hybrid):
    """A step's read-back fails whole while the next step, already launched, samples
    another request's first token: the requests of the failed step end, and the
    other one (its token lost in flight, its last prompt token to be fed again)
    is recomputed, since its state already took that token in; it still equals
    mlx-lm."""
    inner = hybrid.model.inner
    eos = set(hybrid.eos_token_ids)
    rng = np.random.default_rng(9)
    a, b = ids(rng, 30), ids(rng, 3)  # b: one chunk (no snapshot point inside)
    want = mlx_lm_greedy(inner, b, MAX_TOKENS, eos)
    engine = Engine(hybrid, EngineConfig(num_blocks=128, block_size=4, step_token_budget=16))
    runner = engine._runner
    real = runner.read
    rid: dict[str, int] = {}

    def read(step):
        second = engine._seqs.get(rid.get("b", -1))
        rows = {r.seq.request_id for r in step.plan.rows}
        if second is not None and second.inflight and rid["a"] in rows - {rid["b"]}:
            rid["b"] = -1  # once
            step.sampled = None
            raise RuntimeError("device lost the step")
        return real(step)

    with closing_at_rest(engine):
        runner.read = read
        base = base_request(engine, max_tokens=40)
        first = run(engine, base, a)
        rid["a"] = first.request_id
        while engine.stats().generated_tokens < 3:
            pass
        second = run(engine, dataclasses.replace(base, max_tokens=MAX_TOKENS), b)
        rid["b"] = second.request_id
        list(first.iter_sync(timeout=TIMEOUT))
        finish(second)
        assert rid["b"] == -1  # the fault fired
        assert second.output_ids == want


def test_a_branch_point_becomes_a_snapshot(hybrid):
    """Two prompts that share a prefix and then differ (one system prompt, other
    questions): the second leaves the cached KV prefix past any snapshot, so its
    prefill stops there for one; the third then restores it."""
    rng = np.random.default_rng(4)
    p = ids(rng, 61)
    engine = Engine(hybrid, EngineConfig(num_blocks=128, block_size=4, step_token_budget=24))
    with closing_at_rest(engine):
        base = base_request(engine)
        a = run(engine, base, p + ids(rng, 7))
        assert finish(a).usage.cached_tokens == 0
        b = run(engine, base, p + ids(rng, 5))
        assert finish(b).usage.cached_tokens == 0  # no snapshot inside p yet
        c_prompt = p + ids(rng, 9)
        c = run(engine, base, c_prompt)
        assert finish(c).usage.cached_tokens == len(p) // 4 * 4
    want = mlx_lm_greedy(hybrid.model.inner, c_prompt, MAX_TOKENS, set(hybrid.eos_token_ids))
    assert c.output_ids == want


def test_snapshots_go_with_their_blocks(hybrid):
    """A pool that cannot keep every prefix: as cached blocks are evicted, the
    snapshots of their prefixes go too (checked at rest), and the capacity holds."""
    rng = np.random.default_rng(8)
    engine = Engine(
        hybrid,
        EngineConfig(
            num_blocks=40,
            block_size=4,
            step_token_budget=16,
            state_snapshots=3,
            snapshot_interval=2,
        ),
    )
    with closing_at_rest(engine):
        base = base_request(engine)
        for _ in range(6):
            finish(run(engine, base, ids(rng, 41)))
            st = engine.stats()
            assert st.state_snapshots <= 3
        assert engine._cache.stats()["evictions"] > 0


def test_another_question_after_the_same_history_hits(hybrid):
    """The last block before a prompt's last user message is a snapshot point: a
    second request with the same system prompt and another question hits there
    at once (not only from the third request on), and equals mlx-lm cold."""
    system = "You are a careful assistant who answers briefly. " * 6

    def chat(question: str) -> ChatRequest:
        return ChatRequest(
            messages=[Message("system", system), Message("user", question)],
            max_tokens=MAX_TOKENS,
            sampling=SamplingParams(temperature=0.0),
        )

    engine = Engine(hybrid, EngineConfig(num_blocks=256, block_size=4, step_token_budget=32))
    with closing_at_rest(engine):
        finish(engine.submit(chat("What is the capital of France?")))
        prep = engine.prepare(chat("Name a prime number."))
        at = prep.last_user_at
        assert at is not None and 0 < at < len(prep.prompt_ids)
        s = engine.submit(prep)
        done = finish(s)
        assert done.usage.cached_tokens == at // 4 * 4
        assert done.usage.cached_tokens >= 0.9 * at
    want = mlx_lm_greedy(hybrid.model.inner, prep.prompt_ids, MAX_TOKENS, set(hybrid.eos_token_ids))
    assert s.output_ids == want


def test_a_forced_tool_call_under_a_grammar(hybrid):
    """Grammar rows sample after their last token is on the host (their look-ahead
    forward pass still runs): with state slots too, a forced call parses and
    validates, streamed from a random-weight hybrid."""
    import json

    from mlx_cairn.types import Tool, ToolCall

    tool = Tool(
        "set_unit",
        "Set the unit",
        {
            "type": "object",
            "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    )
    engine = Engine(hybrid, EngineConfig(num_blocks=800, block_size=4, step_token_budget=64))
    with closing_at_rest(engine):
        reqs = [
            ChatRequest(
                [Message("user", f"Pick a unit, {i}.")],
                max_tokens=400,  # (a random model spends many on the layout's whitespace)
                sampling=SamplingParams(temperature=t, seed=i),
                tools=[tool],
                tool_choice="required",
                parallel_tool_calls=False,
            )
            for i, t in enumerate((0.0, 0.8, 1.0))
        ]
        streams = [engine.submit(r) for r in reqs]
        for s in streams:
            events = list(s.iter_sync(timeout=TIMEOUT))
            calls = [e for e in events if isinstance(e, ToolCall)]
            assert isinstance(events[-1], Done) and events[-1].stop_reason == "tool_use", events
            assert len(calls) == 1 and calls[0].name == "set_unit"
            assert json.loads(calls[0].arguments)["unit"] in ("celsius", "fahrenheit")

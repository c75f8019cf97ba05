"""Engine API: validation, async streams from any loop, faults, close, pool sizing."""

from __future__ import annotations

import asyncio
import threading

import pytest

import mlx_cairn
from mlx_cairn.engine import Engine, EngineConfig, paged
from mlx_cairn.engine.config import DEFAULT_MAX_BATCH
from mlx_cairn.engine.stats import EngineStats
from mlx_cairn.errors import ContextLengthExceeded, EngineError, InvalidRequest
from mlx_cairn.testing.engine_checks import (
    assert_at_rest,
    closing_at_rest,
    greedy_reference,
    submit_together,
)
from mlx_cairn.testing.tiny_models import tiny_model
from mlx_cairn.types import Admitted, ChatRequest, Done, Error, Message, SamplingParams, TextDelta

TIMEOUT = 60.0


@pytest.fixture(scope="module")
def lm():
    return tiny_model("qwen3", seed=1)


@pytest.fixture
def engine(lm):
    with closing_at_rest(Engine(lm, EngineConfig(num_blocks=128, block_size=8))) as e:
        yield e


def req(text: str = "Hello world", max_tokens: int = 16, **kw) -> ChatRequest:
    kw.setdefault("sampling", SamplingParams(temperature=0.0))
    return ChatRequest(messages=[Message("user", text)], max_tokens=max_tokens, **kw)


def test_lazy_export_is_the_engine():
    assert mlx_cairn.Engine is Engine


@pytest.mark.parametrize(
    ("request_", "param"),
    [
        (ChatRequest(messages=[]), "messages"),
        (req(max_tokens=0), "max_tokens"),
        (req(sampling=SamplingParams(temperature=-1.0)), "temperature"),
        (req(sampling=SamplingParams(temperature=float("nan"))), "temperature"),
        (req(sampling=SamplingParams(top_p=0.0)), "top_p"),
        (req(sampling=SamplingParams(top_k=-2)), "top_k"),
        (req(sampling=SamplingParams(min_p=1.5)), "min_p"),
        (req(stop=[""]), "stop"),
    ],
)
def test_invalid_requests_fail_before_any_work(engine, request_, param):
    with pytest.raises(InvalidRequest) as e:
        engine.submit(request_)
    assert e.value.param == param
    assert engine.stats().requests_total == 0


def test_context_length_is_checked_up_front(engine, lm):
    n = engine.count_tokens(req())
    with pytest.raises(ContextLengthExceeded):
        engine.prepare(req(max_tokens=lm.context_length - n + 1))
    # Fits the model's context but not the 127 x 8 token pool.
    with pytest.raises(ContextLengthExceeded, match="KV cache"):
        engine.submit(req(max_tokens=127 * 8 - n + 1))
    assert engine.prepare(req(max_tokens=127 * 8 - n)).max_tokens == 127 * 8 - n


def test_count_tokens_equals_usage_input_tokens(engine):
    r = req("count me please", max_tokens=4)
    n = engine.count_tokens(r)
    assert n == len(engine.prepare(r).prompt_ids)
    done = list(engine.generate_sync(r, timeout=TIMEOUT))[-1]
    assert isinstance(done, Done) and done.usage.input_tokens == n


def test_clamp_max_tokens_gives_the_room_left(engine):
    n = engine.count_tokens(req())
    room = min(engine.context_length, (engine._pools.num_blocks - 1) * engine.block_size) - n
    with pytest.raises(ContextLengthExceeded) as exc:
        engine.prepare(req(max_tokens=room + 1))
    assert exc.value.room == room
    assert engine.prepare(req(max_tokens=room + 1), clamp_max_tokens=True).max_tokens == room
    assert engine.prepare(req(max_tokens=5), clamp_max_tokens=True).max_tokens == 5
    with pytest.raises(ContextLengthExceeded):  # the prompt alone leaves no room: no clamping
        engine.prepare(req("word " * (room + n)), clamp_max_tokens=True)


def test_count_tokens_ignores_max_tokens_and_capacity(engine, lm):
    n = engine.count_tokens(req("count me please"))
    # max_tokens past the context, or not a valid max_tokens at all: still counted.
    assert engine.count_tokens(req("count me please", max_tokens=lm.context_length)) == n
    assert engine.count_tokens(req("count me please", max_tokens=0)) == n
    # A prompt larger than the 127 x 8 token pool (and than the context) has a size too.
    big = req("word " * (lm.context_length + 50), max_tokens=1)
    m = engine.count_tokens(big)
    assert m > lm.context_length > 127 * 8
    with pytest.raises(ContextLengthExceeded):
        engine.prepare(big)
    with pytest.raises(InvalidRequest):
        engine.count_tokens(ChatRequest(messages=[]))
    assert engine.stats().requests_total == 0


def test_async_generate_and_early_close_cancels(engine, lm):
    async def main() -> tuple[list[int], int]:
        full = engine.submit(req(max_tokens=24))
        got = [ev async for ev in full]
        assert isinstance(got[-1], Done)
        agen = engine.generate(req("a long one", max_tokens=200))
        n = 0
        async for _ev in agen:
            n += 1
            if n == 2:
                break
        await agen.aclose()
        return full.output_ids, n

    ids, n = asyncio.run(main())
    assert n == 2
    assert ids == greedy_reference(lm, engine.prepare(req(max_tokens=24)).prompt_ids, 24)
    assert_at_rest(engine)
    assert engine.stats().requests_cancelled == 1


def test_streams_on_several_loops_at_once(engine):
    results: dict[int, list] = {}

    def consume(i: int) -> None:
        async def run() -> list:
            return [ev async for ev in engine.generate(req(f"loop {i}", max_tokens=12))]

        results[i] = asyncio.run(run())

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert sorted(results) == [0, 1, 2]
    for events in results.values():
        assert isinstance(events[-1], Done)
        assert isinstance(events[0], Admitted)
        assert all(isinstance(e, (TextDelta, Done)) for e in events[1:])


def test_fault_in_a_step_fails_only_that_step(engine):
    fail = threading.Event()

    def hook() -> None:
        if fail.is_set():
            fail.clear()
            raise RuntimeError("injected fault")

    engine._fault_hook = hook
    fail.set()
    victim = list(engine.generate_sync(req("victim"), timeout=TIMEOUT))
    assert isinstance(victim[-1], Error) and "injected fault" in victim[-1].message
    assert_at_rest(engine)
    after = list(engine.generate_sync(req("survivor"), timeout=TIMEOUT))
    assert isinstance(after[-1], Done)
    assert engine.stats().requests_failed == 1


def test_fault_mid_decode_fails_the_batch_but_not_the_queue(lm):
    e = Engine(lm, EngineConfig(num_blocks=128, block_size=8, max_batch=2))
    steps = []

    def hook() -> None:
        steps.append(1)
        if len(steps) == 5:  # step 1 prefills both rows, steps 2.. decode them
            raise RuntimeError("boom")

    e._fault_hook = hook
    try:
        # Both rows prefill in step 1.
        batch = submit_together(e, [req(f"first {i}", max_tokens=40) for i in range(2)])
        queued = e.submit(req("queued"))  # max_batch=2: waits outside the batch
        for s in batch:
            last = list(s.iter_sync(TIMEOUT))[-1]
            assert isinstance(last, Error) and last.kind == "internal", last
            # At most steps 1-4 sampled a token for a row (a row submitted just
            # after step 1 started prefills in step 2; step 4's token may still be
            # in flight when step 5 fails and be dropped with the failed rows).
            assert 1 <= len(s.output_ids) <= 4, s.output_ids
        assert isinstance(list(queued.iter_sync(TIMEOUT))[-1], Done)
        assert_at_rest(e)
    finally:
        e.close()


def test_close_ends_pending_streams_and_refuses_new_work(lm):
    e = Engine(lm, EngineConfig(num_blocks=64, block_size=8))
    gate = threading.Event()
    e._fault_hook = lambda: gate.wait(TIMEOUT)
    streams = [e.submit(req(f"r{i}", max_tokens=50)) for i in range(3)]
    closer = threading.Thread(target=e.close)
    closer.start()
    gate.set()
    closer.join(TIMEOUT)
    for s in streams:
        last = list(s.iter_sync(TIMEOUT))[-1]
        assert isinstance(last, (Done, Error))
    with pytest.raises(EngineError):
        e.submit(req())


def test_pool_sizing(lm):
    model = lm.model
    per_block = 2 * model.num_layers * 16 * model.num_kv_heads * model.head_dim * 4
    e = Engine(lm, EngineConfig(kv_cache_gb=1000 * per_block / 2**30))
    try:
        assert e.stats().blocks_total == 999
        assert e.stats().kv_cache_bytes == 1000 * per_block
    finally:
        e.close()
    with pytest.raises(ValueError, match="does not fit"):
        Engine(lm, EngineConfig(kv_cache_gb=1e6))
    with pytest.raises(ValueError):
        Engine(lm, EngineConfig(kv_cache_gb=-1))
    with pytest.raises(ValueError):
        Engine(lm, EngineConfig(num_blocks=1))
    default = Engine(lm)
    try:
        st = default.stats()
        # Enough for max_batch full contexts, never more (the tiny model's are small).
        assert st.blocks_total == DEFAULT_MAX_BATCH * lm.context_length // 16
        assert st.kv_cache_bytes <= paged.DEFAULT_MAX_BYTES
    finally:
        default.close()


@pytest.mark.parametrize(
    ("context", "max_batch", "avail_gib", "blocks"),
    [
        (8192, 16, 64, 2048),  # 16 contexts would take 8 GiB: the 2 GiB cap binds
        (65536, 16, 64, 4097),  # one context needs 4 GiB: the cap rises to it
        (8192, 16, 2, 512),  # a quarter of available memory binds
        (8192, 2, 64, 1025),  # max_batch full contexts is enough
    ],
)
def test_default_pool_rule(monkeypatch, context, max_batch, avail_gib, blocks):
    monkeypatch.setattr(paged, "available_memory_bytes", lambda: avail_gib << 30)
    got = paged.pool_blocks(
        1 << 20,  # 1 MiB per 16-token block
        num_blocks=None,
        kv_cache_gb=None,
        default_tokens=max_batch * context,
        block_size=16,
        context_tokens=context,
    )
    assert got == blocks


def test_stats_are_typed_and_consistent(engine):
    st = engine.stats()
    assert isinstance(st, EngineStats)
    assert st.blocks_free + st.blocks_in_use == st.blocks_total > 0
    assert st.block_size == engine.block_size
    with pytest.raises(AttributeError):  # a misspelt field fails loudly
        getattr(st, "requests_" + "requests")
    assert set(st.as_dict()) >= {"queue_depth", "running", "blocks_cached", "preemptions"}


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"decode_share": 1.5}, "decode_share"),
        ({"block_size": 0}, "block_size"),
        ({"max_batch": -2}, "max_batch"),
        ({"gather_s": 11}, "gather_s"),
        ({"speculative": "ngram", "draft_model": object()}, "pick one"),
        ({"num_speculative_tokens": 65}, "num_speculative_tokens"),
        ({"kv_disk_dir": "/tmp/x", "kv_disk_gb": 0}, "kv_disk_gb"),
    ],
)
def test_config_refuses_bad_options_before_any_model(options, match):
    """The options are checked when the config is built: no model, no pools."""
    with pytest.raises(ValueError, match=match):
        EngineConfig(**options)


def test_config_is_exported_and_frozen():
    import dataclasses

    import mlx_cairn
    from mlx_cairn.engine.config import DEFAULT_DISK_GB
    from mlx_cairn.types import DEFAULT_NUM_SPECULATIVE

    assert mlx_cairn.EngineConfig is EngineConfig
    cfg = EngineConfig(max_batch=4)
    assert cfg.speculative_tokens == DEFAULT_NUM_SPECULATIVE and cfg.disk_gb == DEFAULT_DISK_GB
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_batch = 8  # type: ignore[misc]

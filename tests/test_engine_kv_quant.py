"""Quantized KV pools end to end (issue 39): the engine with ``kv_bits`` against mlx-lm's
own generation with ``QuantizedKVCache`` on the same random-weight model."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from mlx_cairn.backends.cpu import attention as cpu_attention
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.testing.engine_checks import closing_at_rest, greedy_base, submit_together
from mlx_cairn.testing.tiny_models import tiny_zoo_model
from mlx_cairn.types import Done

TIMEOUT = 60.0
#: Quantization noise flips near-tied tokens even between two mlx-lm runs that
#: only chunk the prompt differently, so tokens are compared teacher-forced: each
#: of ours must be within a margin of mlx-lm's best logit at that position. The
#: margin is mlx-lm against itself (prompt in chunks of 5 vs whole: the largest
#: gap of the other run's picks), doubled, plus FLOOR for float rounding.
FLOOR = 1e-3


@pytest.fixture(scope="module")
def lm():
    # head_dim 64: one group of mlx-lm's default size per head.
    return tiny_zoo_model("llama", seed=3, head_dim=64)


def _ids(engine: Engine, prompt: list[int], n: int) -> list[int]:
    base = greedy_base(engine, n)
    s = engine.submit(dataclasses.replace(base, prompt_ids=list(prompt), max_tokens=n))
    assert isinstance(list(s.iter_sync(timeout=TIMEOUT))[-1], Done)
    return list(s.output_ids)


def _mlx_lm_logits(inner, tokens: list[int], prompt_len: int, bits: int, chunk: int) -> np.ndarray:
    """mlx-lm's logits predicting tokens[prompt_len:], quantized cache from position 0,
    prompt in chunks of ``chunk``, then one token per call (teacher-forced)."""
    # mlx-lm's own caches, each KVCache quantized (recurrent layers keep theirs).
    cache = [
        QuantizedKVCache(group_size=64, bits=bits) if type(c) is KVCache else c
        for c in make_prompt_cache(inner)
    ]
    out = []
    with cpu_attention.disabled():
        at = 0
        while at < prompt_len:
            end = min(prompt_len, at + chunk)
            logits = inner(mx.array([tokens[at:end]]), cache=cache)[0, -1]
            at = end
        out.append(logits)
        for t in tokens[prompt_len:-1]:
            out.append(inner(mx.array([[t]]), cache=cache)[0, -1])
    return np.array(mx.stack(out))


def _gaps(logits: np.ndarray, picked: list[int]) -> np.ndarray:
    return logits.max(axis=1) - logits[np.arange(len(picked)), picked]


PROMPTS = [[(7 * i + k) % 200 + 3 for i in range(37 + 5 * k)] for k in range(3)]


@pytest.fixture(scope="module")
def hybrid():
    # Gated-delta (recurrent) layers and full attention, head_dim 64.
    return tiny_zoo_model("qwen3_next", seed=3, head_dim=64)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("which", ["lm", "hybrid"])
def test_teacher_forced_against_mlx_lm(request, which, bits):
    lm = request.getfixturevalue(which)
    inner = lm.model.inner
    with closing_at_rest(Engine(lm, EngineConfig(num_blocks=64, block_size=16, kv_bits=bits))) as e:
        for prompt in PROMPTS:
            ours = _ids(e, prompt, 12)
            ref = _mlx_lm_logits(inner, prompt + ours, len(prompt), bits, chunk=len(prompt))
            other = _mlx_lm_logits(inner, prompt + ours, len(prompt), bits, chunk=5)
            margin = 2 * _gaps(ref, list(other.argmax(axis=1))).max() + FLOOR
            assert _gaps(ref, ours).max() <= margin, (prompt, ours)
        pools = e._pools
        kv = [k for k in pools.k if k is not None]
        assert pools.kv_bits == bits and all(k[0].dtype == mx.uint32 for k in kv)
        for arrs in pools.state:  # recurrent state stays full precision
            assert arrs is None or all(a.dtype != mx.uint32 for a in arrs)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"kv_bits": 3}, "kv_bits must be 8 or 4"),
        ({"kv_bits": 16}, "kv_bits must be 8 or 4"),
        ({"kv_bits": 8, "kv_group_size": 128}, "does not divide layer 0's key head dimension 64"),
    ],
)
def test_bad_settings_refuse_to_start(lm, kw, message):
    with pytest.raises(ValueError, match=message):
        Engine(lm, EngineConfig(num_blocks=16, block_size=16, **kw))


def test_budget_holds_more_tokens(lm):
    blocks = {}
    for bits in (None, 8, 4):
        e = Engine(lm, EngineConfig(kv_cache_gb=0.01, block_size=16, kv_bits=bits))
        blocks[bits] = e._pools.num_blocks
        e.close()
    assert blocks[8] > 1.5 * blocks[None] and blocks[4] > 2.5 * blocks[None], blocks


def test_prefix_sharing_partial_copy_and_preemption_on_quantized_blocks(lm):
    # Every answer equals a fresh engine's: shared blocks (by reference), rows
    # copied out of a cached block (packed rows + scales + biases) and a row
    # preempted and recomputed all read the same quantized rows.
    shared = [(11 * i) % 150 + 5 for i in range(16 + 9)]
    prompts = [[*shared, 30 + k, 31, 32] for k in range(3)]
    fresh = []
    for p in prompts:
        with closing_at_rest(
            Engine(lm, EngineConfig(num_blocks=64, block_size=16, kv_bits=8))
        ) as e:
            fresh.append(_ids(e, p, 8))
    with closing_at_rest(Engine(lm, EngineConfig(num_blocks=64, block_size=16, kv_bits=8))) as e:
        assert [_ids(e, p, 8) for p in prompts] == fresh
        st = e.stats()
        assert st.prefix_hit_tokens >= 2 * 16 and st.partial_hit_tokens > 0
        assert st.kv_bits == 8 and st.kv_pool_tokens == 63 * 16
    # A pool of 6 usable blocks: three rows of 4 blocks each cannot all run at once.
    with closing_at_rest(
        Engine(
            lm,
            EngineConfig(
                num_blocks=7,
                block_size=16,
                kv_bits=8,
                max_batch=3,
                step_token_budget=64,
                decode_share=0,  # rows side by side: the share may let one finish first
            ),
        )
    ) as e:
        base = greedy_base(e, 8)
        long = [[(5 * i + k) % 190 + 3 for i in range(30)] for k in range(3)]
        want = []
        for p in long:
            with closing_at_rest(
                Engine(lm, EngineConfig(num_blocks=64, block_size=16, kv_bits=8))
            ) as f:
                want.append(_ids(f, p, 20))
        subs = submit_together(  # they meet in the pool
            e, [dataclasses.replace(base, prompt_ids=p, max_tokens=20) for p in long]
        )
        for s in subs:
            assert isinstance(list(s.iter_sync(timeout=TIMEOUT))[-1], Done)
        assert [list(s.output_ids) for s in subs] == want
        assert e.stats().preemptions > 0


def test_serve_refuses_bad_kv_settings():
    import argparse

    from mlx_cairn.cli.serve import ServeError, add_arguments, build

    p = argparse.ArgumentParser()
    add_arguments(p)
    for bad in (
        ["--kv-bits", "3"],
        ["--kv-bits", "16"],
        ["--kv-bits", "8", "--kv-group-size", "48"],
    ):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
    args = p.parse_args(["--kv-bits", "8"])
    args.kv_bits = 3  # a Namespace built in code is checked too
    with pytest.raises(ServeError, match="kv_bits must be 8 or 4"):
        build(args, {})


def test_own_architecture_and_speculative_verification_on_quantized_blocks():
    # models/llama.py (the embedded default's code) takes the packed triples
    # through cpu_attention.attention; n-gram speculation verifies over them.
    from mlx_cairn.testing.tiny_models import tiny_model

    own = tiny_model("qwen3", seed=4)  # head_dim 32
    prompt = [(3 * i) % 20 + 5 for i in range(40)]  # repetitive: drafts get proposed
    got = {}
    for spec in (None, "ngram"):
        with closing_at_rest(
            Engine(
                own,
                EngineConfig(
                    num_blocks=64, block_size=16, kv_bits=8, kv_group_size=32, speculative=spec
                ),
            )
        ) as e:
            got[spec] = _ids(e, prompt, 16)
            if spec:
                assert e.stats().spec_draft_tokens > 0
    assert got["ngram"] == got[None]
    with closing_at_rest(Engine(own, EngineConfig(num_blocks=64, block_size=16))) as e:
        full = _ids(e, prompt, 16)
    assert full[:4] == got[None][:4]  # 8-bit noise is small: the first tokens agree


def test_sliding_window_layers_are_quantized_too():
    # mlx-lm does not quantize its rotating (sliding-window) caches, so there is
    # no quantized reference: the 8-bit answer must follow full precision's
    # first tokens, and every KV layer's pool must be packed.
    lm = tiny_zoo_model("gemma3_text", seed=3, head_dim=64)
    prompt = [(7 * i) % 200 + 3 for i in range(40)]  # longer than the window (8)
    with closing_at_rest(Engine(lm, EngineConfig(num_blocks=64, block_size=16, kv_bits=8))) as e:
        q8 = _ids(e, prompt, 8)
        assert all(k is None or k[0].dtype == mx.uint32 for k in e._pools.k)
        assert any(s.window for s in e._pools.layers)
    with closing_at_rest(Engine(lm, EngineConfig(num_blocks=64, block_size=16))) as e:
        full = _ids(e, prompt, 8)
    assert q8[:3] == full[:3]


def test_disk_tier_keeps_quantized_blocks_and_ignores_other_settings(lm, tmp_path):
    # Written at 8 bits; a restart at 8 bits hits the prefix from disk with the same
    # greedy answer as a cold 8-bit engine; restarts at full precision and at 4 bits
    # find nothing of it (another KV format) and answer as their cold engines do.
    system = [(13 * i) % 180 + 5 for i in range(4 * 16 + 3)]
    again = [*system, 50, 51, 52]

    def engine(bits, disk=True):
        kw = {"kv_disk_dir": tmp_path, "kv_disk_gb": 0.05} if disk else {}
        return Engine(lm, EngineConfig(num_blocks=32, block_size=16, kv_bits=bits, **kw))

    with closing_at_rest(engine(8)) as e:
        _ids(e, [*system, 40, 41], 4)
    assert list(tmp_path.glob("*/*.kvb")), "the 8-bit blocks were not kept at close"
    for bits in (8, None, 4):
        with closing_at_rest(engine(bits, disk=False)) as e:
            cold = _ids(e, again, 8)
        with closing_at_rest(engine(bits)) as e:
            out = _ids(e, again, 8)
            st = e.stats()
        assert out == cold, bits
        if bits == 8:
            assert st.disk_hit_blocks >= 4 and st.prefix_hit_tokens >= 4 * 16, st
        else:
            assert st.disk_hit_blocks == 0 and st.prefix_hit_tokens == 0, st


def test_quantized_blocks_evicted_from_a_small_pool_come_back_from_disk(lm, tmp_path):
    # 12 prompts of 3 blocks through a pool of 11: the second round's prefixes were
    # evicted to disk while running, read back packed, and answer as the first round.
    prompts = [[(17 * i + 3 * k) % 190 + 5 for i in range(41)] for k in range(12)]
    with closing_at_rest(
        Engine(
            lm,
            EngineConfig(
                num_blocks=12, block_size=16, kv_bits=8, kv_disk_dir=tmp_path, kv_disk_gb=0.05
            ),
        )
    ) as e:
        first = [_ids(e, p, 3) for p in prompts]
        assert e._disk.drain()
        second = [_ids(e, p, 3) for p in prompts]
        st = e.stats()
    assert second == first
    assert st.disk_written_blocks > 0 and st.disk_hit_blocks >= 12, st


@pytest.fixture(scope="module")
def folder(lm, tmp_path_factory):
    from mlx_cairn.models.export import save_folder

    path = tmp_path_factory.mktemp("kvq") / "tiny"
    save_folder(lm, path)
    return path


def _serve_build(folder, *flags: str):
    import argparse

    from mlx_cairn.cli.serve import add_arguments, build

    p = argparse.ArgumentParser()
    add_arguments(p)
    problems: list[str] = []
    reg, config = build(p.parse_args(["--model", str(folder), *flags]), {}, problems=problems)
    reg.preload()  # what `cairn serve --preload` does before it answers
    return reg, config, problems


def test_serve_refuses_a_group_size_that_does_not_divide_the_head_dimension(folder):
    # The head dimension is known once the model is loaded: a loaded model's
    # problem stops `cairn serve` before it serves (run() prints it and exits 2).
    reg, _, problems = _serve_build(folder, "--kv-bits", "4", "--kv-group-size", "128")
    reg.close()
    assert len(problems) == 1
    assert "--kv-bits 4 --kv-group-size 128 does not suit" in problems[0]
    assert "does not divide layer 0's key head dimension 64" in problems[0]


def test_health_metrics_and_start_up_log_say_how_many_tokens_the_pool_holds(folder, lm, caplog):
    import logging

    from fastapi.testclient import TestClient

    from mlx_cairn.api import create_app

    budget = 0.01
    with caplog.at_level(logging.INFO, logger="mlx_cairn.engine"):
        reg, config, problems = _serve_build(folder, "--kv-bits", "8", "--kv-cache-gb", str(budget))
    try:
        assert not problems
        (engine,) = [sm.engine for sm in reg.models if sm.engine is not None]
        pools = engine._pools
        tokens = (pools.num_blocks - 1) * pools.block_size
        with TestClient(create_app(reg, config)) as c:
            (entry,) = c.get("/health").json()["models"]
            metrics = c.get("/metrics").text
    finally:
        reg.close()
    assert entry["stats"]["kv_pool_tokens"] == tokens and entry["stats"]["kv_bits"] == 8
    (line,) = [m for m in metrics.splitlines() if m.startswith("cairn_kv_pool_tokens{")]
    assert float(line.rsplit(" ", 1)[1]) == tokens
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV pool:")]
    assert any(f"({tokens} tokens), 8-bit, groups of 64" in m for m in logged), logged
    # The same budget at full precision (fp32 here) holds under a third of that.
    full = Engine(lm, EngineConfig(kv_cache_gb=budget, block_size=pools.block_size))
    held = full.stats().kv_pool_tokens
    full.close()
    assert 3 * held < tokens, (held, tokens)

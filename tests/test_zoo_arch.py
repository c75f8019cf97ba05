"""mlx-lm architectures over the paged engine: greedy tokens equal mlx-lm's own generation.

For each architecture a tiny random-weight model is built from mlx-lm's own
classes (testing/tiny_configs.py: real config shapes, a few layers). The
engine runs several prompts of different lengths batched together, with
chunked prefill and one prompt that hits the prefix cache; every row's greedy
tokens must equal a plain single-sequence loop over the same mlx-lm model
with mlx-lm's own caches (``make_prompt_cache``: KVCache / RotatingKVCache).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.testing.engine_checks import closing_at_rest, greedy_base
from mlx_cairn.testing.tiny_configs import TINY_CONFIGS, WRAPPERS
from mlx_cairn.testing.tiny_models import mlx_lm_greedy, tiny_zoo_model
from mlx_cairn.types import Done

TIMEOUT = 120.0
MAX_TOKENS = 10


def prompts(seed: int) -> dict[str, list[int]]:
    rng = np.random.default_rng(seed)

    def ids(n: int) -> list[int]:
        return [int(x) for x in rng.integers(3, 360, size=n)]

    long = ids(37)
    return {
        "long": long,
        "short": ids(5),
        "mid": ids(19),
        "prefix": long[:26] + ids(7),  # shares 6 full blocks of 4 with "long"
        "longer": ids(52),
    }


def run(engine: Engine, base, ids: list[int]):
    return engine.submit(dataclasses.replace(base, prompt_ids=ids, max_tokens=MAX_TOKENS))


def finish(stream) -> Done:
    events = list(stream.iter_sync(timeout=TIMEOUT))
    assert isinstance(events[-1], Done), events[-1]
    return events[-1]


@pytest.mark.parametrize("model_type", sorted([*TINY_CONFIGS, *WRAPPERS]))
def test_batched_paged_greedy_equals_mlx_lm(model_type):
    lm = tiny_zoo_model(model_type, seed=1)
    inner = lm.model.inner
    # The head runs only on the positions the engine asks for (not inside __call__).
    assert not lm.model.computes_logits_in_call
    eos = set(lm.eos_token_ids)
    ps = prompts(seed=7)
    want = {k: mlx_lm_greedy(inner, v, MAX_TOKENS, eos) for k, v in ps.items()}
    # The tokens must not all be one id, or the comparison would prove little.
    assert len({t for v in want.values() for t in v}) > 3, want

    # A small step budget chunks the prefills (windows cross chunk and block edges).
    engine = Engine(lm, EngineConfig(num_blocks=512, block_size=4, step_token_budget=16))
    # Decode rows attend over a mirror whatever their length (the default spares short rows).
    engine._pools.mirror_min_positions = 0
    mirrored = []
    mirror_for = engine._pools.mirror_for

    def recording(rows, starts):
        got = mirror_for(rows, starts)
        mirrored.append(got is not None)
        return got

    engine._pools.mirror_for = recording
    with closing_at_rest(engine):
        base = greedy_base(engine, MAX_TOKENS)
        first = run(engine, base, ps["long"])
        assert finish(first).usage.cached_tokens == 0
        got = {"long": first.output_ids}
        names = ["short", "mid", "prefix", "longer"]
        streams = [run(engine, base, ps[k]) for k in names]
        dones = [finish(s) for s in streams]
        for k, s in zip(names, streams, strict=True):
            got[k] = s.output_ids
        assert dones[names.index("prefix")].usage.cached_tokens == 24
        assert engine.stats().prefix_hit_tokens >= 24
    assert got == want
    assert sum(mirrored) >= MAX_TOKENS, mirrored

"""``cairn serve`` flags that shape a model: --context-length and the Claude Code fit line."""

from __future__ import annotations

import argparse
import logging
from typing import Any

import pytest

from mlx_cairn.cli.serve import (
    CLAUDE_CODE_CONTEXT,
    ServeError,
    add_arguments,
    build,
    claude_code_fit,
    override_context,
)
from mlx_cairn.testing.engine_checks import closing_at_rest
from mlx_cairn.testing.tiny_models import tiny_model


def args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_context_length_overrides_the_model_and_warns_above_training(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lm = tiny_model("llama")
    trained = lm.context_length
    with caplog.at_level(logging.WARNING, logger="mlx_cairn.api"):
        override_context(lm, trained // 2)
    assert lm.context_length == trained // 2 and not caplog.records
    with caplog.at_level(logging.WARNING, logger="mlx_cairn.api"):
        override_context(lm, trained * 4)
    assert lm.context_length == trained * 4
    assert f"above the {trained} tokens it was trained for" in caplog.text


def test_the_flag_reaches_the_engine() -> None:
    registry, _ = build(args("--context-length", "1000"), {})
    lm = tiny_model("llama")
    engine: Any = registry.lifecycle.engine_factory(lm)
    with closing_at_rest(engine):
        assert engine.context_length == 1000 == lm.context_length
    with pytest.raises(ServeError, match="--context-length"):
        build(args("--context-length", "1"), {})


def test_claude_code_fit_line() -> None:
    small = claude_code_fit("smol", 8192)
    assert "too few" in small and f"--context-length {2 * CLAUDE_CODE_CONTEXT}" in small
    assert "enough" in claude_code_fit("big", 131072)


def test_a_kv_pool_that_cannot_be_sized_names_the_flag() -> None:
    """The pool's sizing refusal is its own type (a ValueError still), and ``build``
    reports it as the ``--kv-cache-gb`` that does not suit the model."""
    from mlx_cairn.errors import KVPoolSizeError

    problems: list[str] = []
    registry, _ = build(args("--kv-cache-gb", "1000000"), {}, problems=problems)
    lm = tiny_model("llama")
    with pytest.raises(KVPoolSizeError, match="does not fit") as e:
        registry.lifecycle.engine_factory(lm)
    assert isinstance(e.value, ValueError)
    assert problems and problems[0].startswith("--kv-cache-gb 1e+06 does not suit")

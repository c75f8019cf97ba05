"""Shared pytest settings: hypothesis budget from CAIRN_HYPOTHESIS_EXAMPLES."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

import mlx_cairn  # noqa: F401  (loads the optimized BLAS before any test imports mlx)

settings.register_profile(
    "cairn",
    max_examples=int(os.environ.get("CAIRN_HYPOTHESIS_EXAMPLES", "100")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("cairn")


@pytest.fixture(scope="session")
def default_model():
    """The embedded SmolLM2 GGUF, loaded once per session (tests using it are marked slow)."""
    from mlx_cairn.models import load

    return load()

"""Shared pytest settings: hypothesis budget from CAIRN_HYPOTHESIS_EXAMPLES."""

from __future__ import annotations

import os

import mlx_cairn  # noqa: F401  (loads the optimized BLAS before any test imports mlx)
from hypothesis import HealthCheck, settings

settings.register_profile(
    "cairn",
    max_examples=int(os.environ.get("CAIRN_HYPOTHESIS_EXAMPLES", "100")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("cairn")

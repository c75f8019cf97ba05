from __future__ import annotations

import mlx_cairn
from mlx_cairn import _core


def test_extension_version_matches_package() -> None:
    assert _core.__version__ == mlx_cairn.__version__

"""``python -m mlx_cairn.cli``: the `cairn` command without the console script."""

import sys

from mlx_cairn.cli import main

sys.exit(main())

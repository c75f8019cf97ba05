"""The `cairn` command: `cairn serve | generate | bench | count ...`.

Each subcommand's module provides ``add_arguments(parser)`` and ``run(args)``
and is registered with ``_lazy``; ``main`` only dispatches.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

Command = Callable[[argparse.Namespace], int]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cairn", description="mlx-cairn: a local LLM server on MLX"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _SUBCOMMANDS:
        add(sub)
    return parser


# Subcommand registrars, appended by the modules below this line.
_SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = []


def _lazy(name: str, help: str, module: str) -> Callable[[argparse._SubParsersAction], None]:
    """Registrar for a subcommand whose ``add_arguments`` and ``run`` live in ``module``.

    The module is imported only when the parser is built, so ``import mlx_cairn.cli``
    stays light; ``run`` is looked up when the command runs.
    """

    def add(sub: argparse._SubParsersAction) -> None:
        p = sub.add_parser(name, help=help)
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        p.set_defaults(func=lambda args: importlib.import_module(module).run(args))

    return add


_SUBCOMMANDS.append(
    _lazy("serve", "serve models over the Anthropic (and OpenAI) HTTP APIs", "mlx_cairn.cli.serve")
)
_SUBCOMMANDS.append(
    _lazy("generate", "stream one chat answer to the terminal", "mlx_cairn.cli.generate")
)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `cairn` console script."""
    args = _build_parser().parse_args(argv)
    func: Command = args.func
    return func(args)


if __name__ == "__main__":
    sys.exit(main())

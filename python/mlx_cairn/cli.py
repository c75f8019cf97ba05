"""The `cairn` command: `cairn serve | generate | bench | count ...`.

Each subcommand lives in its own ``_cmd_*`` function and registers its
arguments in ``_add_*``; ``main`` only dispatches.
"""

from __future__ import annotations

import argparse
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


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve models over the Anthropic (and OpenAI) HTTP APIs")
    from mlx_cairn.api.server import add_arguments

    add_arguments(p)
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    from mlx_cairn.api.server import run

    return run(args)


_SUBCOMMANDS.append(_add_serve)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="stream one chat answer to the terminal")
    from mlx_cairn.chat.generate_cli import add_arguments

    add_arguments(p)
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args: argparse.Namespace) -> int:
    from mlx_cairn.chat.generate_cli import run

    return run(args)


_SUBCOMMANDS.append(_add_generate)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `cairn` console script."""
    args = _build_parser().parse_args(argv)
    func: Command = args.func
    return func(args)


if __name__ == "__main__":
    sys.exit(main())

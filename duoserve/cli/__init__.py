"""The ``duoserve`` command: ``duoserve generate --prompt ...``, ``duoserve serve``, ...

``args`` defines the flags, ``configs`` turns them into the config tree, ``commands`` runs
each subcommand. ``main`` is the entry point of ``duoserve``, ``python -m duoserve`` and
``python -m duoserve.cli``.
"""

from __future__ import annotations

import sys

from duoserve.cli.args import build_parser
from duoserve.cli.commands import run_command
from duoserve.errors import ConfigError, DuoserveError

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra_args = parser.parse_known_args(argv)
    if extra_args and args.command != "ray-node":
        parser.parse_args(argv)   # the usual error for unknown arguments
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return run_command(args, extra_args)
    except (ConfigError, DuoserveError) as exc:
        print(f"duoserve: error: {exc}", file=sys.stderr)
        return 2

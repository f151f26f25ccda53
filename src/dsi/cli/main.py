"""Entry point of the ``dsi`` command: builds the parser from the command modules and dispatches.

Each module listed in ``COMMAND_MODULES`` exposes ``register(subparsers)``, which adds its
sub-commands and sets ``func(args) -> int`` on them. Modules are imported here, so they must not
import heavy dependencies (torch, transformers, ray) at module level.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from dsi.cli.args import flag_message
from dsi.errors import DSIError

COMMAND_MODULES = (
    "dsi.cli.generate",
    "dsi.cli.bench",
    "dsi.cli.sim",
    "dsi.cli.measure",
    "dsi.cli.serve",
    "dsi.cli.selftest",
)


class Parser(argparse.ArgumentParser):
    """argparse with the CLI's error style: one line naming the flag and value, exit 2 (argparse
    would print the whole usage first; ``--help`` still shows it). Sub-commands inherit it."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {flag_message(message)} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="dsi",
        description="Distributed Speculative Inference: lossless, faster LLM decoding.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # command group not built yet
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # --help (0) or a usage error (2, already printed): a code, like every error
        return stop.code if isinstance(stop.code, int) else 2
    if args.command is None:
        parser.print_help()
        return 2
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except DSIError as exc:
        print(f"dsi {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dsi {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

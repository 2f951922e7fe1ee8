"""`specdecode generate | serve | bench | models`: the parser and the dispatch. A user error ends in one line
and exit code 2. Each subcommand lives in its own module and adds its own parser; none imports another."""

from __future__ import annotations

import argparse
import logging
import sys

from specdecode.cli import bench, generate, models, serve
from specdecode.errors import SpecDecodeError

SUBCOMMANDS = (generate, serve, bench, models)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdecode", description="Lossless speculative decoding.")
    commands = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        module.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="warning: %(message)s")
    try:
        return args.run(args)
    except SpecDecodeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130

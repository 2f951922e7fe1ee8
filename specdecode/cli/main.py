"""`specdecode generate | serve | bench | check | advise | models | inspect | convert | train`: the parser and the dispatch. A user error ends in one line
and exit code 2, Ctrl-C in "interrupted" and 130, never a traceback. Each subcommand lives in its own module and
adds its own parser; none imports another. This module imports nothing heavy at the top, so that Ctrl-C during
the imports of torch and the models (the first second or two) is answered like any other."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from specdecode.errors import SpecDecodeError


class OneLineParser(argparse.ArgumentParser):
    """argparse's mistakes as one `error:` line and exit code 2, like ours (subcommands inherit the class)."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    from specdecode.cli import advise, bench, check, convert, generate, inspect_model, models, serve, train

    parser = OneLineParser(prog="specdecode", description="Lossless speculative decoding.")
    commands = parser.add_subparsers(dest="command", required=True)
    for module in (generate, serve, bench, check, advise, models, inspect_model, convert, train):
        module.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Ctrl-C ends the command at once. Raised as KeyboardInterrupt it can land inside a library's import, where
    # some library swallows it and leaves a half-imported module behind (numpy.linalg, and a RecursionError
    # later, seen 1 run in 2 with Ctrl-C 0.3 s after start). Nothing is lost by exiting: output is flushed as
    # it is written, caches are written whole or not at all, and `serve` installs uvicorn's own handler.
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, _exit_interrupted) if in_main_thread else None
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt:  # a handler other than ours raised it (another thread's main, uvicorn's re-raise)
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        if in_main_thread:
            signal.signal(signal.SIGINT, previous)


def _exit_interrupted(signum, frame) -> None:
    print("\ninterrupted", file=sys.stderr, flush=True)
    os._exit(130)


def run(argv: list[str]) -> int:
    for index, arg in enumerate(argv, start=1):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:  # bytes that are not UTF-8 arrive as lone surrogates (surrogateescape)
            print(f"error: command-line argument {index} is not UTF-8 text: {arg!r}", file=sys.stderr)
            return 2
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_request:  # --help (0) or a parser error (2), already printed
        return exit_request.code if isinstance(exit_request.code, int) else 0
    args.argv = argv  # what a command that relaunches itself (train --nproc, under torchrun) runs again
    logging.basicConfig(level=logging.WARNING, format="warning: %(message)s")
    try:
        return args.run(args)
    except SpecDecodeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

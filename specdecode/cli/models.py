"""`specdecode models`: the default models and whether they are ready."""

from __future__ import annotations

import argparse

from specdecode.models.formats.default_models import DEFAULT_MODELS, status


def add_parser(commands) -> None:
    commands.add_parser("models", help="list the default models and whether they are ready").set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    for model in DEFAULT_MODELS.values():
        print(f"{model.name:32} {model.role:7} {model.size / 1e9:5.2f} GB  {status(model)}")
    return 0

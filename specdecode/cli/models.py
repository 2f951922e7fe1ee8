"""`specdecode models`: the default models and whether they are ready; with `--drafts-for M`, which installed
models can draft for M."""

from __future__ import annotations

import argparse

from specdecode.models.formats.default_models import DEFAULT_MODELS, status
from specdecode.models.pairing import installed_defaults, model_facts, pair


def add_parser(commands) -> None:
    models = commands.add_parser("models", help="list the default models and whether they are ready; "
                                 "--drafts-for M: which models can draft for M")
    models.add_argument("--drafts-for", metavar="MODEL",
                        help="a default name, a .gguf file or a model folder: list the installed default models "
                        "and --candidate models that can draft for it (same vocabulary, smaller)")
    models.add_argument("--candidate", action="append", default=[], metavar="MODEL",
                        help="with --drafts-for: another model to consider (repeatable)")
    models.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.drafts_for is None:
        for model in DEFAULT_MODELS.values():
            print(f"{model.name:32} {model.role:7} {model.size / 1e9:5.2f} GB  {status(model)}")
        return 0
    target = model_facts(args.drafts_for)
    names = [n for n in dict.fromkeys([*installed_defaults(), *args.candidate]) if n != args.drafts_for]
    pairings = sorted((pair(target, model_facts(name)) for name in names),
                      key=lambda p: (not p.can_draft, p.ratio))
    print(f"drafts for {target.name} ({target.parameters / 1e9:.2f}B parameters, {len(target.tokens)} tokens):")
    for p in pairings:
        verdict = "can draft" if p.can_draft else "cannot"
        print(f"  {p.candidate.name:40} {p.candidate.parameters / 1e9:6.2f}B  {p.ratio:5.2f}x  {verdict:9}  {p.note}")
    usable = [p for p in pairings if p.can_draft]
    if usable:
        print(f"try: specdecode generate \"...\" --model {args.drafts_for} --draft-model {usable[0].candidate.name} "
              "--spec-type ngram,draft --compare-plain")
    else:
        print("none of these can draft for it; methods without a draft model still do: --spec-type ngram or suffix")
    return 0

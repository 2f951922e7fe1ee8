"""`specdecode inspect [MODEL] [--json]`: what a model is, which drafters it brings or has beside it, and which
methods it can use, in the seed's order of advice. No weights are loaded (models/survey.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from specdecode.drafters.registry import with_own_weights
from specdecode.models.formats.default_models import DEFAULT_TARGET
from specdecode.models.formats.drafter_folder import trained_folder

if TYPE_CHECKING:
    from specdecode.models.survey import ModelSurvey


def add_parser(commands) -> None:
    inspect = commands.add_parser("inspect", help="what a model is and which speculative methods it can use "
                                  "(MTP layers, drafters beside it, draft models), without loading its weights")
    inspect.add_argument("model", nargs="?", default=DEFAULT_TARGET,
                         help=f"a default name, a .gguf file or a model folder (default {DEFAULT_TARGET})")
    inspect.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    inspect.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specdecode.models.families.registry import why_not_run
    from specdecode.models.loader import resolve_source
    from specdecode.models.survey import drafters_beside, survey

    source = resolve_source(args.model, quiet=args.json)
    facts = survey(source)
    drafters = drafters_beside(source, [trained_folder(kind, args.model) for kind in with_own_weights()])
    drafts = _draft_models(args.model) if facts.runs else []
    methods = _methods(facts, drafters, drafts)
    report = {
        "model": args.model, "source": str(source), "format": "gguf" if source.is_file() else "folder",
        "architecture": facts.architecture, "runs_here": facts.runs,
        "mtp": {"declared": facts.mtp_declared, "present": facts.mtp_present, "naming": facts.mtp_naming,
                "dropped": facts.mtp_dropped,
                "companion": str(facts.mtp_companion) if facts.mtp_companion is not None else None},
        "drafters_beside": [{"kind": kind, "path": str(path)} for kind, path in drafters],
        "draft_models": drafts,
        "methods": [{"method": m, "usable": usable, "why": why, "flags": flags} for m, usable, why, flags in methods],
    }
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"{args.model}: {report['format']} at {source}")
    why_not = why_not_run(facts.architecture) or "this runtime does not run it"
    print(f"  architecture: {facts.architecture} ({'runs here' if facts.runs else why_not})")
    print(f"  MTP layers: {facts.mtp_line()}")
    print("  drafters beside it: " + (", ".join(f"{kind} at {path}" for kind, path in drafters) or "none found"))
    print("  draft models installed: " + (", ".join(drafts) or "none with its vocabulary and at most half its size"))
    print("  methods, in the order to try them:")
    for method, usable, why, flags in methods:
        print(f"    {method:8} {'yes' if usable else 'no ':3}  {why}{f' ({flags})' if flags else ''}")
    first = next(((m, flags) for m, usable, _, flags in methods if usable), None)
    if first is not None:
        print(f"try: specdecode generate \"...\" --model {args.model} {first[1] or '--spec-type ' + first[0]} "
              "--compare-plain; --spec-type auto combines what was found, step by step")
    return 0


def _draft_models(model: str) -> list[str]:
    from specdecode.models.pairing import MAX_USEFUL_RATIO, installed_defaults, model_facts, pair

    facts = model_facts(model)
    pairings = [pair(facts, model_facts(name)) for name in installed_defaults() if name != model]
    return [p.candidate.name for p in sorted(pairings, key=lambda p: p.ratio)
            if p.can_draft and p.ratio <= MAX_USEFUL_RATIO]


def _methods(facts: ModelSurvey, drafters: list[tuple[str, Path]], drafts: list[str]
             ) -> list[tuple[str, bool, str, str]]:
    """(method, usable, why, the flags that use it) in the seed's order: MTP, EAGLE-3, a draft model, then a
    DFlash or DSpark drafter (the newest), then lookups."""
    if not facts.runs:
        return [("none", False, f"this runtime does not run {facts.architecture!r} models yet", "")]
    heads = [path for kind, path in drafters if kind == "eagle3"]
    blocks = {kind: [path for found, path in drafters if found == kind] for kind in ("dflash", "dspark")}
    from specdecode.models.survey import assistant_titles

    shipped = assistant_titles()
    assistants = [(kind, path) for kind, path in drafters if kind in shipped]
    others = sorted({kind for kind, _ in drafters if kind not in {"eagle3", "dflash", "dspark", *shipped}})
    if facts.mtp_present:
        rows = [("mtp", True, f"ships {facts.mtp_present} MTP layer(s), no other download", "--spec-type mtp")]
    elif facts.mtp_companion is not None:
        rows = [("mtp", True, f"{facts.mtp_companion_layers} MTP layer(s) in {facts.mtp_companion.name} beside it, "
                 "read with it", "--spec-type mtp")]
    elif assistants:  # a family that ships its MTP as an assistant model (Gemma 4)
        kind, path = assistants[0]
        rows = [("mtp", True, f"the {shipped[kind]} {path.name} beside it", "--spec-type mtp")]
    elif facts.mtp_dropped:
        rows = [("mtp", False, "its config declares MTP layers but this file dropped them: use a file that keeps "
                 "them, or `specdecode train mtp`", "")]
    else:
        rows = [("mtp", False, "no MTP layers: `specdecode train mtp` trains them onto it", "")]
    rows.append(("eagle3", True, "an EAGLE-3 head for it", f"--spec-type eagle3 --draft-head {heads[0]}") if heads
                else ("eagle3", False, "no EAGLE-3 head found: `specdecode train eagle3 --target MODEL` trains one", ""))
    rows.append(("draft", True, "a smaller model with its vocabulary", f"--spec-type draft --draft-model {drafts[0]}")
                if drafts else ("draft", False, "no installed model with its vocabulary and at most half its size", ""))
    for kind, name in (("dspark", "DSpark"), ("dflash", "DFlash")):
        rows.append((kind, True, f"a {name} drafter for it", f"--spec-type {kind} --draft-head {blocks[kind][0]}")
                    if blocks[kind] else (kind, False, f"no {name} drafter found: `specdecode train {kind} --target "
                                          "MODEL` trains one", ""))
    rows.append(("suffix", True, "always: text that repeats (code edits, structured output, agents)",
                 "--spec-type suffix"))
    rows.append(("ngram", True, "always: repeats of the prompt itself", "--spec-type ngram"))
    if others:
        rows.append((others[0], False, f"found {', '.join(others)} beside it; this runtime does not run them yet", ""))
    return rows

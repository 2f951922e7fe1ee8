"""Options several subcommands share (models, speculation, sampling) and turning them into our settings.

The speculative options come from the drafter registry: each drafter's own options become flags here, under
our name and the llama.cpp name where there is one, so a new drafter's options touch only its own file.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from specdecode.config import COMBINE_RULES, DEFAULT_VERIFICATION, VERIFICATION_RULES, SamplingParams, SpecConfig
from specdecode.drafters import capabilities
from specdecode.drafters.registry import (
    DRAFTERS,
    all_options,
    check_options_apply,
    drafter_paths,
    needs_draft_files,
    needs_draft_model,
    resolve_spec,
)
from specdecode.errors import SpecDecodeError
from specdecode.models.formats.default_models import DEFAULT_DRAFT, DEFAULT_TARGET

if TYPE_CHECKING:
    from specdecode.engine.engine import Engine


def add_model_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("models")
    group.add_argument("--model",
                       help=f"target: a default name, a .gguf file or a model folder (default {DEFAULT_TARGET})")
    group.add_argument("--draft-model", help=f"draft model for --spec-type draft (default {DEFAULT_DRAFT} "
                       "when --model is not given)")
    group.add_argument("--draft-head", help="weights of a drafter with a format of its own, e.g. an EAGLE-3 head "
                       "folder for --spec-type eagle3 or a DFlash folder for dflash (there --draft-model PATH works "
                       "too, unless a draft model is used as well); for several such drafters at once, "
                       "METHOD=PATH,METHOD=PATH (eagle3=./head,dflash=./dflash)")
    group.add_argument("--dtype", default="auto", help="auto (bf16 where supported), bfloat16, float32, float16")
    group.add_argument("--draft-dtype", help="dtype of the draft model (default: --dtype); never changes the output")
    group.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    group.add_argument("--quant", default="auto",
                       help="target weights: auto (default: a GGUF of 4-bit K-quants runs as w4a8 where this CPU "
                       "has the kernel, anything else as stored, in --dtype; one line says what and why), none, "
                       "int8 (per channel), int4 (group-wise) or w4a8 (int4 weights with int8 activations on our "
                       "kernel: x86 CPUs with AVX2 and FMA, AVX-512 VNNI where present, ARM with the dot product; "
                       "compiled at first use), w3a8 (the same kernel with 3-bit weights, meant for drafts); "
                       "greedy identity holds against the target as loaded, quantization included")
    group.add_argument("--draft-quant", default="auto",
                       help="draft weights, the draft model's and an EAGLE-3 head's: auto (on CPU w4a8 where it "
                       "runs, int4 where it does not; none elsewhere), "
                       "none, int8, int4, w4a8 or w3a8 (3-bit layers on the w4a8 kernel, each group's range "
                       "searched, the output head as w4a8's); a cheaper draft never changes the output")
    group.add_argument("--group-size", type=int, default=32, help="inputs per int4 group (default 32)")
    group.add_argument("--context", type=int, help="context limit in tokens (default: the model's)")


def add_spec_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("speculative decoding")
    aliases = ", ".join(f"{a} ({cls.name})" for cls in DRAFTERS.values() for a in cls.aliases)
    group.add_argument("--spec-type", help=f"{', '.join(DRAFTERS)}, or a combination such as ngram,draft; "
                       f"llama.cpp's names too: {aliases}; auto (the default): every drafter found for the model "
                       "(its MTP layers, an EAGLE-3 head from --draft-head or where 'specdecode train eagle3' puts "
                       "it, a draft model from --draft-model or an assembled smaller sibling) after suffix, with "
                       "--combine best; asked for by name, one line says what it chose (the stats always name the "
                       "chain)")
    group.add_argument("--num-draft-tokens", "--draft-max", type=int, default=3,
                       help="tokens drafted per step (default 3; --draft-max is llama.cpp's name)")
    group.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True,
                       help="adapt the draft length to recent acceptance (default on)")
    group.add_argument("--combine", choices=COMBINE_RULES, default="first",
                       help="how a combination such as ngram,draft picks each step's proposal: first (llama.cpp's "
                       "rule: the "
                       "first method with a draft) or best (the most expected tokens per second, from acceptance "
                       "and costs measured as it runs); default first")
    group.add_argument("--guard", action=argparse.BooleanOptionalAction, default=True,
                       help="never slower than plain: shrink, then pause drafting while it measures slower, and "
                       "probe again later (default on; with sampling, --no-guard keeps timing out of what a seeded "
                       "run draws)")
    group.add_argument("--verification", choices=VERIFICATION_RULES, default=None,
                       help="how sampled drafts are verified: coupled (each position's randomness fixed by --seed: "
                       "the output is plain decoding's at that seed, token for token, however it was drafted), "
                       "block (a chain jointly, Sun et al. 2025: the most tokens accepted in expectation) or token "
                       "(token by token, Leviathan et al.); all lossless, greedy decoding the same under each; "
                       f"default {DEFAULT_VERIFICATION['seeded']} with --seed, else "
                       f"{DEFAULT_VERIFICATION['unseeded']}")
    group.add_argument("--relaxed-acceptance", metavar="RULE[:VALUE]",
                       help="opt-in LOSSY acceptance that keeps more drafts, so the output is no longer exactly the "
                       "target's: typical[:EPSILON] (Medusa's typical acceptance, default 0.09) or threshold[:P] "
                       "(keep a draft the target gives at least P, as SGLang's accept threshold; default 0.3); "
                       "labelled lossy in stats, responses and bench, and `check` fails it; default off")
    for name, (cls, item) in all_options().items():
        primary = "--" + name.replace("_", "-")
        flags = [primary, *(f for f in (item.metadata["llama_cpp"], *item.metadata["cli"]) if f and f != primary)]
        kind = type(item.default)
        typed = {"action": argparse.BooleanOptionalAction} if kind is bool else {"type": kind}
        group.add_argument(*flags, dest=name, default=None, **typed,
                           help=f"[{cls.name}] {item.metadata['help']} (default {item.default})")


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=256, help="new tokens at most (default 256)")
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--seed", type=int)
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-turn tokens")


def check_model_args(args: argparse.Namespace) -> None:
    """Flags that would fail only after minutes of loading fail now, in one line."""
    from specdecode.models.loader import check_device

    if args.context is not None and args.context < 1:
        raise SpecDecodeError(f"--context must be >= 1 (leave it out for the model's limit), got {args.context}")
    check_device(args.device)


def default_draft_name(args: argparse.Namespace) -> str | None:
    """--draft-model, or the default draft when the target is the default one too."""
    return args.draft_model or (DEFAULT_DRAFT if args.model is None else None)


def draft_sources(args: argparse.Namespace, spec_needs_model: bool, spec_needs_files: bool,
                  load_draft_anyway: bool = False) -> tuple[str | None, str | None]:
    """(the draft model to load, or None; the path a drafter reads its own weights from, or None).
    load_draft_anyway: serve's --allow-draft-override, a draft model for requests that ask for one."""
    path = drafter_paths(args.draft_head)
    wanted = spec_needs_model or load_draft_anyway
    # Beside a draft model, a drafter's own weights come from --draft-head only; one that needs them says so.
    if spec_needs_files and path is None and not spec_needs_model:
        path = args.draft_model  # --draft-model names the head here; a draft model can only be the default
        return (DEFAULT_DRAFT if wanted and args.model is None else None), path
    return (default_draft_name(args) if wanted else None), path


def load_models(args: argparse.Namespace, draft_name: str | None, quiet: bool = False):
    """The target and (when named) the draft, each with its own dtype and quantization flags."""
    from specdecode.models.loader import load_model

    check_model_args(args)
    target = load_model(DEFAULT_TARGET if args.model is None else args.model, args.dtype, args.device, quiet,
                        args.quant, args.group_size)  # --model "" is a mistake to report, not the default
    draft = (load_model(draft_name, args.draft_dtype or args.dtype, args.device, quiet,
                        draft_quant(args, quiet), args.group_size) if draft_name else None)
    return target, draft


def draft_quant(args: argparse.Namespace, quiet: bool = True) -> str:
    """'auto': the cheapest draft the device has kernels for, since a draft's precision never changes the output
    (on the default pair, an int4 draft keeps its acceptance and costs 40% of a bf16 one, and a w4a8 draft is
    cheaper still: docs/benchmarks). w4a8 where this CPU runs our kernel (AVX2 + FMA at least) and it compiles,
    else int4. Not w3a8, though its drafted token is cheaper: end to end it decoded no faster on 18 unseen prompts
    (1.25x plain both), accepted fewer drafts (68% against 73%) and adds minutes to the first run (#62)."""
    if args.draft_quant != "auto":
        return args.draft_quant
    if args.device != "cpu":
        return "none"
    from specdecode.models.kernels.w4a8_linear import w4a8_unavailable

    reason = w4a8_unavailable(quiet) if args.group_size == 32 else "it needs --group-size 32"
    if reason and not quiet:
        print(f"draft in int4, not w4a8: {reason}", file=sys.stderr)
    return "int4" if reason else "w4a8"


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          max_tokens=args.max_tokens, seed=args.seed, stop=tuple(args.stop),
                          ignore_eos=args.ignore_eos)


def drafter_options(args: argparse.Namespace) -> dict:
    """The drafter options given on the command line (the rest keep each drafter's default)."""
    return {name: getattr(args, name) for name in all_options() if getattr(args, name, None) is not None}


def spec_from_args(args: argparse.Namespace, default: str = "auto") -> SpecConfig:
    """The method and options given (without --spec-type: `default`; auto for commands that decode with it,
    measured ahead of ngram,draft and within 5% of the best single method: docs/benchmarks, 2026-12-02 auto),
    checked against the registry before any model loads."""
    spec = resolve_spec(SpecConfig(args.spec_type or default, args.num_draft_tokens, args.adaptive,
                                   drafter_options(args), guard=args.guard, combine=args.combine,
                                   relaxed=args.relaxed_acceptance, verification=args.verification))
    if default != "none" or args.spec_type:  # bench and advise take options for the methods they list instead
        check_options_apply(spec.methods, drafter_options(args))
    return spec


def build_engine(args: argparse.Namespace, specs: list[SpecConfig], quiet: bool = False,
                 load_draft_anyway: bool = False, prefix_cache_bytes: int = 0) -> Engine:
    """The models `specs` need and the Engine over them, for every command: the target, a draft model when a
    method drafts with one, the folders of drafters with weights of their own, and for `auto` whatever it finds
    for the target (drafters/auto.py). specs[0] is the engine's default. `load_draft_anyway`: serve's
    --allow-draft-override, a draft model for requests that ask for one. With --spec-type auto asked for by name,
    one line on stderr says what auto runs and why."""
    from specdecode.drafters.auto import AutoDrafter, find_sources
    from specdecode.engine.engine import Engine

    wants_model = load_draft_anyway or any(needs_draft_model(spec) for spec in specs)
    draft_name, draft_path = draft_sources(args, wants_model, any(needs_draft_files(spec) for spec in specs))
    if any(capabilities.finds_sources(DRAFTERS[method]) for spec in specs for method in spec.methods):
        found = find_sources(args.model, args.draft_model, args.draft_head)
        draft_name = draft_name or found.draft_model
        draft_path = found.draft_paths or draft_path
    target, draft = load_models(args, draft_name, quiet)
    engine = Engine(target, draft, specs[0] if specs else None, context_limit=args.context, draft_path=draft_path,
                    draft_quant=draft_quant(args), prefix_cache_bytes=prefix_cache_bytes)
    if args.spec_type == "auto" and not (quiet or getattr(args, "quiet", False)):
        print(AutoDrafter.describe(engine.resources), file=sys.stderr)
    began = time.perf_counter()
    warmed = engine.warm_up()  # the first request then runs as fast as later ones (engine/warm_up.py)
    if not (quiet or getattr(args, "quiet", False)):
        print(f"[warmed up in {time.perf_counter() - began:.1f} s: a short request each by {', '.join(warmed)}]",
              file=sys.stderr)
    return engine

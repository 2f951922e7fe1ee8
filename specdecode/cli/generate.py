"""`specdecode generate`: stream one completion, then report stats (and the speedup over plain decoding)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace

from specdecode.cli.draft_colours import LEGEND, DraftColours
from specdecode.cli.options import (
    add_model_args,
    add_sampling_args,
    add_spec_args,
    build_engine,
    sampling_from_args,
    spec_from_args,
)
from specdecode.config import SpecConfig
from specdecode.engine.engine import Engine
from specdecode.engine.memory import memory_report, peak_rss_bytes, rss_bytes
from specdecode.engine.stats import GenerationStats
from specdecode.errors import SpecDecodeError
from specdecode.models.tokenizer import check_text


def add_parser(commands) -> None:
    generate = commands.add_parser("generate", help="generate text for one prompt, streaming")
    generate.add_argument("prompt", help="the prompt text, or - to read it from stdin")
    generate.add_argument("--raw", action="store_true", help="do not apply the chat template")
    generate.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    generate.add_argument("--compare-plain", action="store_true",
                          help="also run plain decoding on the same prompt and report the speedup")
    generate.add_argument("--quiet", action="store_true", help="no progress or stats on stderr")
    generate.add_argument("--show-drafts", action="store_true",
                          help="colour each token by where it came from: an accepted draft, the target's bonus token, "
                          "its correction of a rejected draft (the tokens' own text, a stop string's included)")
    add_model_args(generate)
    add_spec_args(generate)
    add_sampling_args(generate)
    generate.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.prompt == "-":
        try:
            prompt = sys.stdin.read()
        except UnicodeDecodeError as error:  # a strict stdin; the usual one maps bad bytes to surrogates
            raise SpecDecodeError(f"the prompt on standard input is not UTF-8 text ({error})") from None
        check_text(prompt, "the prompt on standard input")
    else:
        prompt = args.prompt
    if not prompt:  # with a chat template an empty message still has tokens: refused alike, raw or not
        raise SpecDecodeError("the prompt is empty" + (" (nothing on standard input)" if args.prompt == "-" else ""))
    sampling = sampling_from_args(args)
    spec = spec_from_args(args)
    before_load = rss_bytes()
    engine = build_engine(args, [spec], quiet=args.quiet or args.json)
    peaks = {"load": peak_rss_bytes()}

    token_ids: list[int] = []
    text: list[str] = []
    colours = DraftColours(engine.target.tokenizer) if args.show_drafts and not args.json else None
    origins, steps = [], []
    for event in engine.generate(prompt, sampling, raw=args.raw, provenance=args.json or args.show_drafts):
        token_ids.extend(event.token_ids)
        text.append(event.text)
        origins.extend(asdict(origin) for origin in event.origins or ())
        steps += [event.step.to_dict()] if event.step is not None else []
        if not args.json:
            sys.stdout.write(event.text if colours is None else colours.text(event))
            sys.stdout.flush()
    stats: GenerationStats = event.stats
    peaks["generate"] = peak_rss_bytes()
    report = {"text": "".join(text), "token_ids": token_ids, "finish_reason": event.finish_reason,
              "stats": stats.to_dict(), "origins": origins, "steps": steps}
    if not args.json:
        sys.stdout.write("\n")
        sys.stdout.flush()
        if not args.quiet:
            print(stats_line(stats), file=sys.stderr)
            if colours is not None:
                print(LEGEND, file=sys.stderr)
    if args.compare_plain:
        report["plain"] = compare_plain(engine, prompt, sampling, args, token_ids, stats)
        peaks["compare_plain"] = peak_rss_bytes()
    report["memory"] = memory_report(engine, stats, before_load, peaks)
    if args.json:
        print(json.dumps(report))
    elif args.compare_plain and not args.quiet:
        plain = report["plain"]
        identical = f"n/a (sampled, {stats.verification} rule)" if plain["identical"] is None else plain["identical"]
        print(f"plain decoding (run second; both runs after the warm-up at load): {plain['tokens_per_second']:.2f} "
              f"tokens/s; speculative speedup {plain['speedup']:.2f}x; identical output: {identical}",
              file=sys.stderr)
    return 0


def compare_plain(engine: Engine, prompt: str, sampling, args, token_ids: list[int], stats: GenerationStats) -> dict:
    """The same prompt through plain decoding in the same process, after the speculative run: the honest
    baseline for the speedup. Both runs are warm (build_engine warmed the engine up at load), so which ran first
    does not favour either. It samples at the seed the speculative run used, by the same rule: under coupled the
    outputs must then be equal."""
    if not args.quiet and not args.json:
        print("[plain decoding on the same prompt, for comparison...]", file=sys.stderr)
    plain = engine.complete(prompt, replace(sampling, seed=stats.seed),
                            SpecConfig("none", verification=stats.verification), raw=args.raw)
    if plain.stats.tokens_per_second == 0:
        raise SpecDecodeError("plain decoding produced no tokens to compare against")
    return {
        "tokens_per_second": round(plain.stats.tokens_per_second, 3),
        "speedup": round(stats.tokens_per_second / plain.stats.tokens_per_second, 3),
        # Sampled runs by the block or token-wise rule are equal only in distribution: identity is promised for greedy
        # decoding and the coupled rule.
        "identical": plain.token_ids == token_ids if sampling.greedy or stats.verification == "coupled" else None,
        "order": "speculative first, plain second, both after the warm-up at load",
    }


def stats_line(stats: GenerationStats) -> str:
    line = (f"[{stats.prompt_tokens} prompt tokens, {stats.new_tokens} new tokens, "
            f"{stats.tokens_per_second:.2f} tokens/s, method {stats.method}")
    if stats.relaxed:
        line += f", LOSSY relaxed acceptance {stats.relaxed}"
    if stats.drafted_tokens:
        line += (f", acceptance {stats.acceptance_rate:.1%}, mean accepted length "
                 f"{stats.mean_accepted_length:.2f}")
    if stats.guard_shrinks or stats.guard_pauses:
        paused = sum(n for reason, n in stats.steps_without_draft.items() if reason.startswith("guard"))
        line += (f", drafting measured slower than plain: shortened {stats.guard_shrinks}x, paused "
                 f"{stats.guard_pauses}x ({paused} steps without drafts)")
    return line + "]"

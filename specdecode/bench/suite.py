"""A benchmark session: every method on the same prompts in one process, then a table, files and a JSON line."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Container
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from specdecode.bench.datasets import Question
from specdecode.bench.divergence import NEAR_TIE_GAP, top2_gap
from specdecode.bench.fresh_process import FreshProcess, fresh_turn_runner
from specdecode.bench.metrics import against_fastest, by_category, summarize
from specdecode.bench.openai_peer import OpenAIPeer
from specdecode.bench.report import choice_lines, table, write_outputs
from specdecode.bench.runner import MethodSpec, QuestionResult, TurnRunner, engine_turn_runner, run_question
from specdecode.config import COMBINE_RULES, VERIFICATION_RULES, SamplingParams, SpecConfig
from specdecode.drafters.registry import all_options, resolve_spec
from specdecode.engine.engine import Engine
from specdecode.errors import SpecDecodeError

RunnerFactory = Callable[[SamplingParams], TurnRunner]
HEADLINE = ("tokens_per_second", "speedup", "mean_accepted_length", "acceptance_rate", "identical_rate",
            "ceiling_speedup")


def parse_methods(text: str, base: SpecConfig) -> list[MethodSpec]:
    """'none,draft,ngram+draft:k=5;ngram_max=3' -> our method specs; '+' chains methods, ':k=N' sets the draft
    length, ':adaptive=on|off' whether it adapts, ':guard=on|off' the speed guard, ':combine=first|best' a
    chain's rule and ':NAME=VALUE' any drafter option (on top of `base`, the command line's settings). 'auto'
    runs the drafters found for the target with per-step choice (drafters/auto.py)."""
    # Plain decoding samples by the rule the methods run by (coupled's Gumbel-max draws or the generator's).
    specs = [MethodSpec("none", "specdecode", "none", SpecConfig("none", verification=base.verification))]
    known = all_options()
    for label in (m.strip() for m in text.split(",") if m.strip()):
        name, _, settings = label.partition(":")
        k, options, guard, combine = base.num_draft_tokens, dict(base.options), base.guard, base.combine
        relaxed, adaptive, verification = base.relaxed, base.adaptive, base.verification
        for setting in filter(None, settings.split(";")):
            key, _, value = setting.partition("=")
            if key == "k" and value.isdigit():
                k = int(value)
            elif key == "guard" and value in ("on", "off"):
                guard = value == "on"
            elif key == "adaptive" and value in ("on", "off"):
                adaptive = value == "on"
            elif key == "combine" and value in COMBINE_RULES:
                combine = value
            elif key == "verification" and value in VERIFICATION_RULES:
                verification = value
            elif key == "relaxed" and value:
                relaxed = None if value == "off" else value
            elif key in known and value:
                options[key] = _option_value(key, value, type(known[key][1].default))
            else:
                rules = f"combine={'|'.join(COMBINE_RULES)}, verification={'|'.join(VERIFICATION_RULES)}"
                raise SpecDecodeError(f"bad method option {setting!r} in {label!r}; use k=N, adaptive=on|off, "
                                      f"guard=on|off, {rules}, relaxed=RULE[:VALUE]|off "
                                      f"or a drafter option ({', '.join(sorted(known))}) as NAME=VALUE")
        spec = resolve_spec(SpecConfig(name.replace("+", ","), k, adaptive, options, guard=guard, combine=combine,
                                       relaxed=relaxed, verification=verification))
        if label in (s.name for s in specs[1:]):
            raise SpecDecodeError(f"method {label!r} is listed twice in --methods")
        if label != "none":
            specs.append(MethodSpec(label, "specdecode", "none", spec))
    return specs


def _option_value(name: str, text: str, kind: type):
    try:
        return text.lower() in ("1", "true", "yes") if kind is bool else kind(text)
    except ValueError:
        raise SpecDecodeError(f"method option {name}={text!r} is not a {kind.__name__}") from None


def run_bench(engine: Engine, questions: list[Question], methods: list[MethodSpec], sampling: SamplingParams,
              peers: list[str], repeats: int, out: Path | None, setup: dict,
              fresh_process: FreshProcess | None = None) -> None:
    """Every method on every question, then the summaries: a table on stdout, files in `out`, a JSON line.
    `fresh_process`: answer each of our turns in a new process (bench/fresh_process.py); None: all in this one."""
    factories = runner_factories(engine, methods, peers, fresh_process)
    cold = {m.name for m in methods if m.family == "specdecode"} if fresh_process is not None else set()
    raw = run_all(questions, methods, factories, sampling, repeats, cold)

    summaries, categories = {}, {}
    for method in methods:
        summaries[method.name] = summarize(raw[method.name], raw[method.baseline])
        categories[method.name] = by_category(raw[method.name], raw[method.baseline])
        if method.family != "specdecode":
            summaries[method.name]["speedup_vs_ours_plain"] = summarize(raw[method.name], raw["none"])["speedup"]
    singles = [m.name for m in methods if m.family == "specdecode" and len(m.spec.methods) == 1
               and m.spec.method not in ("none", "auto")]
    for method in methods:
        if singles and method.family == "specdecode" and "auto" in method.spec.methods:
            summaries[method.name]["against_fastest_single"] = against_fastest(method.name, singles, summaries,
                                                                               categories)
    if sampling.greedy:
        explain_divergences(engine, questions, methods, summaries, raw)
    else:  # sampled outputs equal plain decoding's only for ours under the coupled rule; others differ by design
        for method in methods:
            if method.family != "specdecode" or method.spec.verification_for(sampling) != "coupled":
                summaries[method.name]["identical_rate"], summaries[method.name]["divergences"] = None, {}
    print(table(summaries))
    choices = choice_lines(summaries)
    if choices:
        print("\n".join(choices[1:]))  # which member each combination's steps chose, promised against realised
    if out is not None:
        write_outputs(out, summaries, categories, raw, setup)
        print(f"wrote {out}/results.json, report.md and plots", file=sys.stderr)
    print(json.dumps({name: {key: s.get(key) for key in HEADLINE} for name, s in summaries.items()}))


def runner_factories(engine: Engine, methods: list[MethodSpec], peers: list[str],
                     fresh_process: FreshProcess | None = None) -> dict[str, RunnerFactory]:
    """Method name -> (sampling -> turn runner); appends the peers' methods to `methods`. With `fresh_process`
    each of our turns runs in a process of its own.

    Each runner of ours gets its own Engine over the same loaded models: a drafter cache that outlives a request
    (suffix's responses) then holds only that method's own earlier answers, not another method's answer to the
    question being measured, nor the warm-up's. The weights drafters load themselves (MTP layers, an EAGLE-3
    head, a reduced draft head) are read-only and shared by every runner's Engine: the warm-up loads them, so the
    first measured question does not pay their load (about 11 s for a trained MTP companion file).

    Each runner's Engine warms up for its method as `serve` and `generate` do for their default (engine/warm_up.py),
    so per-step choice starts from the warm measures a user's process has: with a default of plain decoding, `auto`
    here priced its draft model by its first timing alone (#62)."""
    def fresh(reference: Engine, spec: SpecConfig) -> Engine:
        engine = Engine(reference.target, reference.draft, SpecConfig("none"), context_limit=reference.context_limit,
                        draft_path=reference.resources.draft_path, draft_quant=reference.resources.draft_quant)
        engine.resources.own_weights = reference.resources.own_weights
        engine.warm_up(spec)
        return engine

    if fresh_process is not None:
        factories: dict[str, RunnerFactory] = {
            m.name: (lambda s, spec=m.spec: fresh_turn_runner(fresh_process, spec, s)) for m in methods}
    else:
        factories = {m.name: (lambda s, spec=m.spec: engine_turn_runner(fresh(engine, spec), spec, s)) for m in methods}
    if "hf" in peers:
        from specdecode.bench.hf_peer import HFPeer

        hf_peer = HFPeer(engine.target, engine.draft)
        for method in hf_peer.methods():
            methods.append(method)
            factories[method.name] = lambda s, name=method.name: hf_peer.turn_runner(name, s)
    for peer in (OpenAIPeer.connect(text) for text in peers if text != "hf"):
        if peer is not None:
            methods.extend(peer.methods())
            factories[peer.methods()[0].name] = peer.turn_runner
    return factories


def run_all(questions: list[Question], methods: list[MethodSpec], factories: dict[str, RunnerFactory],
            sampling: SamplingParams, repeats: int, cold: Container[str] = frozenset()
            ) -> dict[str, list[list[QuestionResult]]]:
    # One short pass per method first, so first-call costs (allocation, kernel selection) are not timed; not for
    # the `cold` ones, whose answers each have a fresh process: its first-call costs are what that mode measures.
    warm_sampling = replace(sampling, max_tokens=min(8, sampling.max_tokens))
    warm_question = Question(questions[0].question_id, questions[0].category, questions[0].turns[:1])
    for name, factory in factories.items():
        if name not in cold:
            run_question(warm_question, factory(warm_sampling))
    raw: dict[str, list[list[QuestionResult]]] = {m.name: [] for m in methods}
    with tqdm(total=len(methods) * len(questions) * repeats, desc="bench", unit="run", file=sys.stderr) as bar:
        for repeat in range(repeats):
            # New runners each repeat (in one process: new Engines over the same models, warmed up): a kept one's
            # suffix cache held its own answers to these very questions, and a repeat then measured recall, not
            # drafting (#62: `auto` ran 1.75x `draft` in a second repeat where the first gave 0.99x).
            runners = {name: factory(sampling) for name, factory in factories.items()}
            for runs in raw.values():
                runs.append([])
            for index, question in enumerate(questions):
                for method in turn_order(methods, index + repeat):
                    raw[method.name][-1].append(run_question(question, runners[method.name]))
                    bar.update()
    return raw


def turn_order(methods: list[MethodSpec], turn: int) -> list[MethodSpec]:
    """The order the methods answer one question in, the `turn`-th question run: question-major, so that every
    method meets the machine in nearly the same state for the same prompt, and rotated by one each question and
    repeat, so that no method always runs first or last, or always right after the same one. A 2-core machine's
    speed drifts by 10-20% over tens of seconds (#62: `auto`'s verify forwards ran 10-17% slower than `draft`'s on
    some prompts and 10-15% faster on others, the same rows each); in a fixed order that drift would sit on one
    method's slot."""
    shift = turn % len(methods) if methods else 0
    return methods[shift:] + methods[:shift]


def explain_divergences(engine: Engine, questions: list[Question], methods: list[MethodSpec],
                        summaries: dict[str, dict], raw: dict[str, list[list[QuestionResult]]]) -> None:
    """For each of our methods' divergences from plain decoding, record the target's top-2 gap there."""
    by_id = {q.question_id: q for q in questions}
    reference = {r.question_id: r.token_ids for r in raw["none"][0]}
    for method in methods:
        if method.family != "specdecode":
            continue
        explained = {}
        for qid, position in summaries[method.name]["divergences"].items():
            gap = top2_gap(engine, by_id[qid], reference[qid], position)
            explained[qid] = {"position": position, "top2_gap": round(gap, 4), "near_tie": gap <= NEAR_TIE_GAP}
        summaries[method.name]["divergences"] = explained

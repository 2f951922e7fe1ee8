"""Learning curves of trained drafters (issue #44): held-out acceptance by draft position against training tokens
and minutes, on each kind of training text, for each training-data choice.

Run from the repository root:
    python docs/benchmarks/training_curves.py [--kinds mtp,eagle3] [--data code,answer,chat,answer+chat]
        [--tokens 40000] [--lrs 3e-4] [--epochs 2] [--draft-vocabs 16000]
        [--bench BENCH_OUT/results.json --bench-datasets A.jsonl,B.jsonl]

The target's features are extracted once into --features (every kind of text `specdecode train` makes: the
standard library's source, teacher-forced; the target's own answers to prompts made from it; its answers to
chat-like prompts (training/chat_tasks.py); --tokens of each, 4,000 held-out tokens of each). Each run then trains
on a folder that links the training shards of one data choice (kinds joined by "+" share the tokens equally; "mix"
is code+answer), all with the same number of training tokens, the same held-out shards and `specdecode train`'s
default settings. Each run's curve is written to OUT/KIND-DATA.jsonl (step, tokens, minutes, held-out acceptance
by kind of text and position), and OUT/curves.png plots them. With --bench, each MTP run is also measured on a
bench run's own plain outputs, teacher-forced (mtp_on_bench_outputs.py), into OUT/on_bench.jsonl.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch
from mtp_on_bench_outputs import mtp_acceptance, write_bench_shards

from specdecode import load_model
from specdecode.cli.train import training_texts
from specdecode.models.formats.default_models import DEFAULT_TARGET
from specdecode.models.formats.drafter_folder import trained_folder
from specdecode.training.chat_tasks import chat_prompts, chat_topics
from specdecode.training.eagle3 import feature_layer_ids, train_eagle3
from specdecode.training.features import check_manifest, extract, shard_files, shard_kind
from specdecode.training.loop import TrainSettings, describe
from specdecode.training.mtp import train_mtp

TRAINERS = {"mtp": train_mtp, "eagle3": train_eagle3}
HELD_OUT_TOKENS = 4_000
TEXT_KINDS = ("answer", "chat", "code")
ON_BENCH = "on_bench.jsonl"  # MTP runs measured on a bench run's outputs; every other OUT/*.jsonl is a curve
ANSWER_TOKENS, MAX_LEN = 192, 768  # as the runs in docs/benchmarks measured (train's default is now 384 tokens)


def extract_all(target, features: Path, tokens: int) -> None:
    layer_ids = feature_layer_ids(target.config.num_layers)
    check_manifest(features, {"target": target.name, "quant": target.quant, "dtype": str(target.model.dtype),
                              "layer_ids": list(layer_ids), "answer_tokens": ANSWER_TOKENS, "max_len": MAX_LEN,
                              "chat": True})
    budget = {(split, kind): tokens if split == "train" else HELD_OUT_TOKENS
              for split in ("train", "held_out") for kind in TEXT_KINDS}
    began = time.perf_counter()
    texts = training_texts(chat_prompts(chat_topics(target, features)))
    done = extract(target, layer_ids, texts, features, budget, ANSWER_TOKENS, MAX_LEN)
    print(f"features: {done} in {(time.perf_counter() - began) / 60:.1f} min (0 if already on disk)", flush=True)


def subset(features: Path, folder: Path, data: str, tokens: int) -> int:
    """A features folder linking the training shards of one data choice (up to `tokens`) and every held-out
    shard -> its training tokens."""
    if folder.exists():
        shutil.rmtree(folder)
    for split in ("train", "held_out"):
        (folder / split).mkdir(parents=True)
    shutil.copy(features / "manifest.json", folder / "manifest.json")
    for path in shard_files(features, "held_out"):
        (folder / "held_out" / path.name).symlink_to(path.resolve())
    kinds = ("code+answer" if data == "mix" else data).split("+")
    wanted = {kind: tokens // len(kinds) for kind in kinds}
    taken = dict.fromkeys(wanted, 0)
    from safetensors import safe_open

    for path in shard_files(features, "train"):
        kind = shard_kind(path)
        if kind in wanted and taken[kind] < wanted[kind]:
            with safe_open(str(path), "pt") as shard:
                taken[kind] += shard.get_slice("tokens").get_shape()[0]
            (folder / "train" / path.name).symlink_to(path.resolve())
    return sum(taken.values())


def plot(out: Path) -> None:
    """OUT/curves.png: per drafter kind and held-out kind, acceptance at draft positions 1 (solid) and 2 (dashed)
    against training tokens, one colour per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {path.stem: [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            for path in sorted(out.glob("*.jsonl")) if path.name != ON_BENCH}
    kinds = sorted({name.split("-")[0] for name in runs})
    held_out_kinds = [kind for kind in TEXT_KINDS
                      if any(kind in points[0]["held_out_acceptance"] for points in runs.values() if points)]
    figure, axes = plt.subplots(len(kinds), len(held_out_kinds), figsize=(5.5 * len(held_out_kinds), 4 * len(kinds)),
                                squeeze=False)
    for row, kind in enumerate(kinds):
        for column, text in enumerate(held_out_kinds):
            axis = axes[row][column]
            for index, (name, points) in enumerate((n, p) for n, p in runs.items() if n.split("-")[0] == kind):
                tokens = [point["tokens"] / 1000 for point in points]
                colour = f"C{index}"
                for position, style in ((0, "-"), (1, "--")):
                    rates = [point["held_out_acceptance"][text][position] for point in points]
                    label = name if "-lr" in name else f"{name}-lr0.0003"
                    axis.plot(tokens, rates, style, color=colour, label=label if position == 0 else None)
            axis.set_title(f"{kind}: held-out {text} (solid: position 1, dashed: 2)", fontsize=9)
            axis.set_xlabel("training tokens seen (thousands)")
            axis.set_ylabel("acceptance")
            axis.set_ylim(0, 1)
            axis.grid(alpha=0.3)
            axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out / "curves.png", dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--kinds", default="mtp,eagle3")
    parser.add_argument("--data", default="code,answer,mix")
    parser.add_argument("--tokens", type=int, default=40_000, help="training tokens per run")
    parser.add_argument("--lrs", default="3e-4", help="peak learning rates to try, each a run")
    parser.add_argument("--epochs", default="2", help="passes over the training tokens to try, each a run")
    parser.add_argument("--draft-vocabs", default="16000", help="draft vocabulary sizes to try, each a run")
    parser.add_argument("--features", default=str(trained_folder("features-curves", None)))
    parser.add_argument("--out", default="docs/benchmarks/2026-12-05-training-curves")
    parser.add_argument("--plot-only", action="store_true", help="redraw OUT/curves.png from the runs in OUT")
    parser.add_argument("--bench", help="a bench run's results.json (with `none`): MTP runs measured on its outputs")
    parser.add_argument("--bench-datasets", default="", help="the datasets that bench run read, comma-separated")
    args = parser.parse_args()
    if args.plot_only:
        plot(Path(args.out))
        return
    torch.manual_seed(0)
    target = load_model(args.target, "auto", "cpu", False, "auto")
    features, out = Path(args.features), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    extract_all(target, features, args.tokens)
    bench_folder = features.parent / f"{features.name}-bench"
    layer_ids = feature_layer_ids(target.config.num_layers)
    if args.bench:
        shutil.rmtree(bench_folder, ignore_errors=True)
        write_bench_shards(target, args.bench, args.bench_datasets.split(","), layer_ids, bench_folder)
    runs = [(kind, data, float(lr), int(epochs), int(vocab)) for kind in args.kinds.split(",")
            for data in args.data.split(",") for lr in args.lrs.split(",") for epochs in args.epochs.split(",")
            for vocab in args.draft_vocabs.split(",")]
    for kind, data, lr, epochs, vocab in runs:
        folder = features.parent / f"{features.name}-{data}"
        trained_tokens = subset(features, folder, data, args.tokens)
        settings = TrainSettings(draft_vocab=vocab, modules=1, eval_every=25, lr=lr, epochs=epochs,
                                 intermediate_size=None if kind == "mtp" else target.config.intermediate_size // 2)
        name = (f"{kind}-{data}" + ("" if lr == 3e-4 else f"-lr{lr:g}") + ("" if epochs == 2 else f"-epochs{epochs}")
                + ("" if vocab == 16000 else f"-vocab{vocab}"))
        curve_path = out / f"{name}.jsonl"
        curve_path.write_text("")
        began = time.perf_counter()

        def record(step: int, tokens: int, measured: dict[str, list[float]], began: float = began,
                   curve_path: Path = curve_path) -> None:
            row = {"step": step, "tokens": tokens, "minutes": (time.perf_counter() - began) / 60,
                   "held_out_acceptance": measured}
            with curve_path.open("a") as curve:
                curve.write(json.dumps(row) + "\n")

        run_dir = trained_folder(f"curves-{name}", None)
        if run_dir.exists():
            shutil.rmtree(run_dir)
        result = TRAINERS[kind](target, folder, run_dir, settings, quiet=True, on_eval=record)
        print(f"{name} ({trained_tokens} tokens, {(time.perf_counter() - began) / 60:.1f} min): "
              f"{describe(result['held_out_accuracy'])}", flush=True)
        if args.bench and kind == "mtp":
            measured = mtp_acceptance(target, run_dir, folder, shard_files(bench_folder, "held_out"), layer_ids)
            with (out / ON_BENCH).open("a") as on_bench:
                on_bench.write(json.dumps({"run": name, "tokens": trained_tokens, "bench": args.bench,
                                           "acceptance": measured}) + "\n")
            print(f"{name} on the bench's plain outputs (code: HumanEval, answer: the rest): {describe(measured)}",
                  flush=True)
        plot(out)


if __name__ == "__main__":
    main()

"""Learning curves of trained drafters (issue #44): held-out acceptance by draft position against training tokens
and minutes, on the target's own answers and on teacher-forced code, for each training-data choice.

Run from the repository root:
    python docs/benchmarks/training_curves.py [--kinds mtp,eagle3] [--data code,answer,mix] [--tokens 40000]

The target's features are extracted once into --features (every kind of text `specdecode train` makes:
the standard library's source, teacher-forced, and the target's own answers to prompts made from it; --tokens of
each, 4,000 held-out tokens of each). Each run then trains on a folder that links the training shards of one data
choice (code: source only, as the old default; answer: the target's answers only; mix: half each), all with the
same number of training tokens, the same held-out shards and `specdecode train`'s default settings. Each run's
curve is written to OUT/KIND-DATA.jsonl (step, tokens, minutes, held-out acceptance by kind of text and position),
and OUT/curves.png plots them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from specdecode import load_model
from specdecode.cli.train import training_texts
from specdecode.models.formats.default_models import DEFAULT_TARGET
from specdecode.models.formats.drafter_folder import trained_folder
from specdecode.training.eagle3 import feature_layer_ids, train_eagle3
from specdecode.training.features import check_manifest, extract, shard_files, shard_kind
from specdecode.training.loop import TrainSettings, describe
from specdecode.training.mtp import train_mtp

TRAINERS = {"mtp": train_mtp, "eagle3": train_eagle3}
HELD_OUT_TOKENS = 4_000
ANSWER_TOKENS, MAX_LEN = 192, 768  # as the runs in docs/benchmarks measured (train's default is now 384 tokens)


def extract_all(target, features: Path, tokens: int) -> None:
    layer_ids = feature_layer_ids(target.config.num_layers)
    check_manifest(features, {"target": target.name, "quant": target.quant, "dtype": str(target.model.dtype),
                              "layer_ids": list(layer_ids), "answer_tokens": ANSWER_TOKENS, "max_len": MAX_LEN})
    budget = {("train", "answer"): tokens, ("train", "code"): tokens, ("held_out", "answer"): HELD_OUT_TOKENS,
              ("held_out", "code"): HELD_OUT_TOKENS}
    began = time.perf_counter()
    done = extract(target, layer_ids, training_texts(), features, budget, ANSWER_TOKENS, MAX_LEN)
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
    wanted = {"code": {"code": tokens}, "answer": {"answer": tokens},
              "mix": {"code": tokens // 2, "answer": tokens - tokens // 2}}[data]
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
            for path in sorted(out.glob("*.jsonl"))}
    kinds = sorted({name.split("-")[0] for name in runs})
    figure, axes = plt.subplots(len(kinds), 2, figsize=(11, 4 * len(kinds)), squeeze=False)
    for row, kind in enumerate(kinds):
        for column, text in enumerate(("answer", "code")):
            axis = axes[row][column]
            for index, (name, points) in enumerate((n, p) for n, p in runs.items() if n.split("-")[0] == kind):
                tokens = [point["tokens"] / 1000 for point in points]
                colour = f"C{index}"
                for position, style in ((0, "-"), (1, "--")):
                    rates = [point["held_out_acceptance"][text][position] for point in points]
                    label = name if "-lr" in name else f"{name}-lr0.0003"
                    axis.plot(tokens, rates, style, color=colour, label=label if position == 0 else None)
            axis.set_title(f"{kind}: held-out {'answers' if text == 'answer' else 'code'} (solid: position 1, "
                           "dashed: 2)")
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
    parser.add_argument("--features", default=str(trained_folder("features-curves", None)))
    parser.add_argument("--out", default="docs/benchmarks/2026-12-05-training-curves")
    parser.add_argument("--plot-only", action="store_true", help="redraw OUT/curves.png from the runs in OUT")
    args = parser.parse_args()
    if args.plot_only:
        plot(Path(args.out))
        return
    torch.manual_seed(0)
    target = load_model(args.target, "auto", "cpu", False, "auto")
    features, out = Path(args.features), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    extract_all(target, features, args.tokens)
    runs = [(kind, data, float(lr)) for kind in args.kinds.split(",") for data in args.data.split(",")
            for lr in args.lrs.split(",")]
    for kind, data, lr in runs:
        folder = features.parent / f"{features.name}-{data}"
        trained_tokens = subset(features, folder, data, args.tokens)
        settings = TrainSettings(draft_vocab=16000, modules=1, eval_every=25, lr=lr,
                                 intermediate_size=None if kind == "mtp" else target.config.intermediate_size // 2)
        name = f"{kind}-{data}" + ("" if lr == 3e-4 else f"-lr{lr:g}")
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
        plot(out)


if __name__ == "__main__":
    main()

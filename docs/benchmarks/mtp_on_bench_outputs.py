"""A trained MTP module's held-out acceptance measured on a bench run's own plain outputs, teacher-forced, beside
its acceptance on the training held-out set: tells a gap between training and use that comes from the text (the
bench's prompts are not like the training prompts) from one that comes from drafting itself.

Run from the repository root after `specdecode train mtp` and a `specdecode bench` run that included `none`:
    python docs/benchmarks/mtp_on_bench_outputs.py BENCH_OUT/results.json DATASET.jsonl [DATASET.jsonl ...]

Each question's first turn is chat-templated, the plain answer appended, and the target's features taken as
training takes them; HumanEval answers count as "code", the others as "answer" in the printed measurement.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from specdecode import load_model
from specdecode.models.formats.default_models import DEFAULT_TARGET
from specdecode.models.formats.drafter_folder import trained_folder
from specdecode.training.eagle3 import feature_columns, max_positions
from specdecode.training.features import shard_files, write_shard
from specdecode.training.loop import TrainSettings, bf16_fast, draft_positions, evaluate, unrolled
from specdecode.training.mtp import MTPUnroll, new_modules


def write_bench_shards(target, results_path: str, datasets: list[str], layer_ids: tuple[int, ...],
                       folder: Path) -> None:
    """folder/held_out: a shard per question of the bench run's plain outputs (its first turn, chat-templated,
    and the plain answer), named -code for HumanEval and -answer for the rest."""
    turns = {}
    for path in datasets:
        for line in Path(path).read_text().splitlines():
            question = json.loads(line)
            turns[str(question["question_id"])] = question["turns"][0]
    (folder / "held_out").mkdir(parents=True, exist_ok=True)
    plain = json.loads(Path(results_path).read_text())["questions"]["none"][0]
    with torch.inference_mode():
        for index, question in enumerate(plain):
            prompt = target.tokenizer.encode_chat([{"role": "user", "content": turns[str(question["question_id"])]}])
            kind = "code" if question["category"] == "humaneval" else "answer"
            write_shard(target.model, folder / "held_out" / f"{index:06d}-{kind}.safetensors",
                         prompt + question["token_ids"][0], len(prompt) - 1, layer_ids)


def mtp_acceptance(target, checkpoint_folder: Path, features: Path, held_out: list[Path],
                   layer_ids: tuple[int, ...]) -> dict[str, list[float]]:
    """The MTP module trained into checkpoint_folder, measured on the held-out shards `held_out` by kind."""
    state = torch.load(checkpoint_folder / "checkpoint.pt", weights_only=True)  # our own checkpoint
    settings = TrainSettings()
    modules = new_modules(target, len({key.split(".")[0] for key in state["head"]}), settings)
    modules.load_state_dict(state["head"])
    draft_ids = state["draft_ids"]  # [Vd]
    target_to_draft = draft_positions(draft_ids, target.config.vocab_size, "cpu")  # [V]
    column = feature_columns(layer_ids, (target.config.num_layers,), target.config.hidden_size)
    objective = unrolled(MTPUnroll(target, modules, column, target.model.output_rows(draft_ids),
                                   max_positions(features)), settings.steps)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_fast("cpu"))
    return evaluate(objective, held_out, target_to_draft, settings, autocast)


def main(results_path: str, datasets: list[str]) -> None:
    features = trained_folder("features", None)
    manifest = json.loads((features / "manifest.json").read_text())
    layer_ids = tuple(manifest["layer_ids"])
    target = load_model(DEFAULT_TARGET, "auto", "cpu", True, manifest["quant"])
    folder = Path(tempfile.mkdtemp())
    write_bench_shards(target, results_path, datasets, layer_ids, folder)
    trained = trained_folder("mtp", None)
    on_bench = mtp_acceptance(target, trained, features, shard_files(folder, "held_out"), layer_ids)
    on_training = mtp_acceptance(target, trained, features, shard_files(features, "held_out"), layer_ids)
    shutil.rmtree(folder)
    for name, measured in (("the bench's plain outputs (code: HumanEval, answer: the rest)", on_bench),
                           ("the training held-out set", on_training)):
        rates = ", ".join(f"{kind} {' / '.join(f'{a:.2f}' for a in values)}" for kind, values in measured.items())
        print(f"{name}: {rates}")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: mtp_on_bench_outputs.py BENCH_OUT/results.json DATASET.jsonl [DATASET.jsonl ...]")
    main(sys.argv[1], sys.argv[2:])

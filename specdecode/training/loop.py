"""The one training loop for every drafter kind: epochs of the training-time test (ttt.py) over features on disk
(features.py), held-out acceptance as it goes, resumable checkpoints, a learning curve; a kind supplies what it
trains and how it writes the result (`Trainee`: training/eagle3.py, training/mtp.py)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from specdecode.errors import SpecDecodeError
from specdecode.models.loader import LoadedModel
from specdecode.training.features import Shard, load_shard, shard_files, shard_kind
from specdecode.training.ttt import UnrollLayer, UnrollResult, unroll

CHECKPOINT = "checkpoint.pt"


@dataclass(frozen=True)
class TrainSettings:
    draft_vocab: int = 32000  # tokens the drafter drafts over (its loss and output rows)
    intermediate_size: int | None = None  # an EAGLE-3 head's MLP width (None: the target's)
    modules: int = 1  # MTP modules, or DFlash layers, to train
    block_size: int = 8  # DFlash and DSpark: slots per block, the root included
    anchors: int = 16  # DFlash and DSpark: blocks per training sequence
    markov_rank: int = 256  # DSpark: the Markov head's rank (0: none)
    markov_kind: str = "vanilla"  # DSpark: vanilla, gated or rnn
    steps: int = 3  # unrolled draft steps (training-time test)
    epochs: int = 2
    lr: float = 3e-4
    warmup: float = 0.05  # share of the steps with a linearly rising learning rate
    eval_every: int = 100  # optimizer steps between held-out measurements (and checkpoints)
    seed: int = 0
    device: str = "cpu"


@dataclass
class Trainee:
    """What a drafter kind hands the loop."""

    kind: str  # "eagle3", "mtp", "dflash", "dspark": names the progress bar and the checkpoint's settings
    module: nn.Module  # the weights trained and checkpointed
    # One sequence's loss and per-draft-position hits: (shard, target_to_draft [V]) -> UnrollResult
    objective: Callable[[Shard, torch.Tensor], UnrollResult]
    save: Callable[[Path], None]  # writes the trained drafter to a folder


def unrolled(layer: UnrollLayer, steps: int) -> Callable[[Shard, torch.Tensor], UnrollResult]:
    """The training-time test (ttt.py) as an objective: for drafters that draft step by step."""
    def objective(shard: Shard, target_to_draft: torch.Tensor) -> UnrollResult:
        return unroll(layer, shard.tokens, shard.hidden, shard.top_ids, shard.top_logprobs, shard.loss_mask,
                      target_to_draft, steps)
    return objective


def train_drafter(build: Callable[[torch.Tensor], Trainee], vocabulary: Callable[[list[Path]], torch.Tensor],
                  target: LoadedModel, features: Path, out: Path, settings: TrainSettings, quiet: bool = False,
                  on_eval: Callable[[int, int, dict[str, list[float]]], None] | None = None) -> dict:
    """Train what `build(draft_ids)` makes, draft_ids [Vd] from `vocabulary(training shards)` (or the checkpoint
    being resumed), on the shards in `features`; write it to `out` -> the last held-out measurement."""
    train_files, held_out = shard_files(features, "train"), shard_files(features, "held_out")
    if not train_files:
        raise SpecDecodeError(f"{features} holds no training features")
    target.model.requires_grad_(False)  # frozen: its embedding and head feed the drafter, no gradient reaches it
    checkpoint = out / CHECKPOINT
    state = _resumed(checkpoint, settings.device)
    draft_ids = state["draft_ids"] if state is not None else vocabulary(train_files)
    trainee = build(draft_ids)
    made_with = _made_with(trainee.kind, settings, train_files + held_out)
    if state is not None and state["made_with"] != made_with:
        changed = sorted(k for k in made_with if state["made_with"].get(k) != made_with[k])
        raise SpecDecodeError(f"{checkpoint} was made with other settings ({', '.join(changed)}); use another "
                              "--out or the same settings")
    lengths = {p: load_shard(p).tokens.numel() for p in train_files + held_out}  # read once, used twice
    trainable = [p for p in trainee.module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
    total = settings.epochs * len(train_files)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, total, settings.warmup))
    step = 0
    if state is not None:
        trainee.module.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        step = state["step"]
    target_to_draft = draft_positions(draft_ids, target.config.vocab_size, settings.device)  # [V]
    autocast = torch.autocast(device_type=torch.device(settings.device).type, dtype=torch.bfloat16,
                              enabled=bf16_fast(settings.device))
    order = [path for epoch in range(settings.epochs) for path in _shuffled(train_files, settings.seed + epoch)]
    measured = evaluate(trainee.objective, held_out, target_to_draft, settings, autocast) if step == 0 \
        else state["measured"]
    tokens_seen = sum(lengths[p] for p in order[:step])  # for the learning curve
    bar = tqdm(total=total, initial=step, unit="seq", desc=f"training {trainee.kind}", disable=quiet)
    bar.set_postfix_str(describe(measured))
    if on_eval is not None and step == 0:
        on_eval(step, 0, measured)
    for path in order[step:]:
        shard = _to(load_shard(path), settings.device)
        with autocast:
            result = trainee.objective(shard, target_to_draft)
        optimizer.zero_grad(set_to_none=True)
        result.loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 0.5)
        optimizer.step()
        schedule.step()
        step += 1
        tokens_seen += shard.tokens.numel()
        bar.update(1)
        if step % settings.eval_every == 0 or step == total:
            measured = evaluate(trainee.objective, held_out, target_to_draft, settings, autocast)
            _save_checkpoint(checkpoint, trainee.module, optimizer, schedule, step, draft_ids, made_with, measured)
            if on_eval is not None:
                on_eval(step, tokens_seen, measured)
        bar.set_postfix_str(f"loss {result.loss.item():.3f} | {describe(measured)}")
    bar.close()
    trainee.save(out)
    return {"held_out_accuracy": measured, "steps": step, "draft_vocab": draft_ids.numel()}


@torch.no_grad()
def evaluate(objective: Callable[[Shard, torch.Tensor], UnrollResult], files: list[Path],
             target_to_draft: torch.Tensor, settings: TrainSettings, autocast) -> dict[str, list[float]]:
    """Per held-out kind (TrainingText.kind: "answer" and "chat", the target's own answers to standard-library
    tasks and to chat-like prompts; "code", teacher-forced code) and draft position,
    how often the drafter's draft is the target's own next token (draft position k's acceptance given the drafts
    before it were right; a next token outside the draft vocabulary counts as a miss)."""
    correct: dict[str, list[int]] = {}
    counted: dict[str, list[int]] = {}
    for path in files:
        shard = _to(load_shard(path), settings.device)
        with autocast:
            result = objective(shard, target_to_draft)
        kind = shard_kind(path)
        correct[kind] = [a + b for a, b in zip(correct.get(kind, [0] * len(result.correct)), result.correct)]
        counted[kind] = [a + b for a, b in zip(counted.get(kind, [0] * len(result.counted)), result.counted)]
    return {kind: [c / max(n, 1) for c, n in zip(correct[kind], counted[kind])] for kind in sorted(correct)}


def draft_positions(draft_ids: torch.Tensor, vocab_size: int, device: str | torch.device) -> torch.Tensor:
    """draft_ids [Vd] -> [V] long: each target id's row in the draft vocabulary, -1 for ids outside it."""
    positions = torch.full((vocab_size,), -1, dtype=torch.long, device=device)  # [V]
    positions[draft_ids.to(device)] = torch.arange(draft_ids.numel(), device=device)
    return positions


def expected_accepted(accuracy: list[float]) -> float:
    """Mean tokens per target step of a chain this long, from the per-position rates (bonus token included)."""
    total, survive = 1.0, 1.0
    for rate in accuracy:
        survive *= rate
        total += survive
    return total


def describe(measured: dict[str, list[float]]) -> str:
    """Held-out acceptance by kind and draft position, and the tokens per target step it would give."""
    return "held-out acceptance " + ", ".join(
        f"{'answers' if kind == 'answer' else kind} {'/'.join(f'{a:.2f}' for a in rates)} "
        f"(~{expected_accepted(rates):.2f} tokens/step)"
        for kind, rates in measured.items())


def _lr_factor(step: int, total: int, warmup: float) -> float:
    rise = max(1, int(total * warmup))
    if step < rise:
        return (step + 1) / rise
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - rise) / max(1, total - rise))))


def _shuffled(files: list[Path], seed: int) -> list[Path]:
    order = list(files)
    random.Random(seed).shuffle(order)
    return order


def _to(shard: Shard, device: str) -> Shard:
    return Shard(*(t.to(device) for t in (shard.tokens, shard.hidden, shard.top_ids, shard.top_logprobs,
                                           shard.loss_mask)))


def bf16_fast(device: str) -> bool:
    from specdecode.models.loader import resolve_dtype

    return resolve_dtype("auto", device) == torch.bfloat16


def _made_with(kind: str, settings: TrainSettings, files: list[Path]) -> dict:
    """What a resumed run must share with the run it continues (the device may change: cpu to cuda)."""
    fields = asdict(settings)
    del fields["device"]
    return {"kind": kind, **fields, "shards": [f"{p.parent.name}/{p.name}" for p in files]}


def _resumed(checkpoint: Path, device: str) -> dict | None:
    if not checkpoint.exists():
        return None
    # Our own file, written below; weights_only refuses anything but tensors and plain data.
    return torch.load(checkpoint, map_location=device, weights_only=True)


def _save_checkpoint(path: Path, module: nn.Module, optimizer, schedule, step: int, draft_ids: torch.Tensor,
                     made_with: dict, measured: dict[str, list[float]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"head": module.state_dict(), "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(),
             "step": step, "draft_ids": draft_ids, "made_with": made_with, "measured": measured}
    torch.save(state, path.with_suffix(".partial"))
    path.with_suffix(".partial").replace(path)

"""The one training loop for every drafter kind: epochs of the training-time test (ttt.py) over features on disk
(features.py), held-out acceptance as it goes, resumable checkpoints, a learning curve; a kind supplies what it
trains and how it writes the result (`Trainee`: training/eagle3.py, training/mtp.py). The same loop runs as one
process or as torchrun's ranks (ranks.py), the drafter copied to each under DDP or sharded under FSDP
(parallel.py), with checkpoints any number of ranks resumes (checkpoint.py)."""

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
from specdecode.training.checkpoint import CHECKPOINT, read_checkpoint, write_checkpoint
from specdecode.training.features import Shard, load_shard, shard_files, shard_kind
from specdecode.training.parallel import Objective, distribute, full_state, load_full_state, sharded, whole_parameters
from specdecode.training.ranks import Ranks, gathered, sum_over_ranks, wait_for_all
from specdecode.training.ranks import current as current_ranks
from specdecode.training.ttt import UnrollLayer, UnrollResult, average_terms, unroll


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
    batch: int | None = None  # sequences per optimizer step, all ranks together (None: one per rank, or resumed)
    device: str = "cpu"
    fsdp: bool = False  # shard the drafter over the ranks (parallel.py) instead of copying it to each


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
    being resumed), on the shards in `features`; write it to `out` -> the last held-out measurement.

    On several ranks (ranks.py) each optimizer step takes the next `batch` sequences of one order every rank
    computes alike, each rank its share; each loss term is averaged over the rows of the whole batch (the
    ranks sum their terms' weights first), so the step is the one a single process takes, whatever the world
    size. Rank 0 alone writes, logs and shows the progress bar; `on_eval` is called on rank 0 only."""
    ranks = current_ranks()
    train_files, held_out = _shards(features)
    target.model.requires_grad_(False)  # frozen: its embedding and head feed the drafter, no gradient reaches it
    checkpoint = out / CHECKPOINT
    state = read_checkpoint(checkpoint, settings.device)
    batch = settings.batch or (state["made_with"]["batch"] if state is not None else ranks.world)
    if batch % ranks.world:
        raise SpecDecodeError(f"a batch of {batch} sequences does not split over {ranks.world} ranks: use a --batch "
                              f"that is a multiple of {ranks.world}")
    draft_ids = state["draft_ids"] if state is not None else vocabulary(train_files)
    trainee = build(draft_ids)
    made_with = _made_with(trainee.kind, settings, batch, train_files + held_out)
    _check_resumable(checkpoint, state, made_with)
    lengths = {p: load_shard(p).tokens.numel() for p in train_files + held_out}  # read once, used twice
    autocast = torch.autocast(device_type=torch.device(settings.device).type, dtype=torch.bfloat16,
                              enabled=bf16_fast(settings.device))
    objective = Objective(trainee.module, trainee.objective, autocast)
    model = distribute(objective, ranks, settings.device, settings.fsdp)
    trainable = [p for p in objective.parameters() if p.requires_grad]  # sharded in place by FSDP: after it
    optimizer = torch.optim.AdamW(trainable, lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
    total = settings.epochs * len(train_files) // batch  # optimizer steps (the last partial batch is left out)
    if total == 0:
        raise SpecDecodeError(f"{len(train_files)} training sequences make no whole batch of {batch}: use a "
                              "smaller --batch or more --tokens")
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, total, settings.warmup))
    step = 0
    if state is not None:
        load_full_state(objective, optimizer, state["head"], state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        step = state["step"]
    target_to_draft = draft_positions(draft_ids, target.config.vocab_size, settings.device)  # [V]
    order = data_order(train_files, settings.epochs, settings.seed)

    def measure() -> dict[str, list[float]]:
        with whole_parameters(objective):
            return evaluate(trainee.objective, held_out, target_to_draft, settings, autocast)

    measured = measure() if step == 0 else state["measured"]
    tokens_seen = sum(lengths[p] for p in order[: step * batch])  # for the learning curve
    bar = tqdm(total=total * batch, initial=step * batch, unit="seq", desc=f"training {trainee.kind}",
               disable=quiet or not ranks.main)
    bar.set_postfix_str(describe(measured))
    if on_eval is not None and step == 0 and ranks.main:
        on_eval(step, 0, measured)
    while step < total:
        chosen = order[step * batch : (step + 1) * batch]  # the step's global batch
        shards = [_to(load_shard(path), settings.device) for path in ranks.share(chosen)]
        step_loss = _optimizer_step(model, optimizer, schedule, trainable, shards, target_to_draft, ranks.world)
        step += 1
        tokens_seen += sum(lengths[p] for p in chosen)
        bar.update(batch)
        if step % settings.eval_every == 0 or step == total:
            measured = measure()
            head, optimizer_state = full_state(objective, optimizer)  # every rank takes part in gathering
            if ranks.main:
                write_checkpoint(checkpoint, head, optimizer_state, schedule.state_dict(), step, draft_ids,
                                 made_with, measured)
                if on_eval is not None:
                    on_eval(step, tokens_seen, measured)
        bar.set_postfix_str(f"loss {step_loss.item():.3f} | {describe(measured)}")
    bar.close()
    _write_result(trainee, build, draft_ids, objective, optimizer, out, ranks)
    return {"held_out_accuracy": measured, "steps": step, "draft_vocab": draft_ids.numel(), "batch": batch}


def _optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, schedule, trainable: list,
                    shards: list[Shard], target_to_draft: torch.Tensor, world: int) -> torch.Tensor:
    """One optimizer step over this rank's `shards` of the global batch -> the whole batch's loss, as one process
    computes it."""
    sums, weights = model(shards, target_to_draft)  # [n_terms] each, this rank's sequences
    all_weights = sum_over_ranks(weights)  # [n_terms]: every rank's rows
    # DDP and FSDP average gradients over ranks: scaled by the world size, the sum of the ranks' terms over all
    # rows is what one process computes over the whole batch.
    loss = average_terms(sums, all_weights) * world
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(trainable, 0.5)
    optimizer.step()
    schedule.step()
    return average_terms(sum_over_ranks(sums.detach()), all_weights)


def _shards(features: Path) -> tuple[list[Path], list[Path]]:
    """The training and held-out shards, the same on every rank (one error on all of them otherwise)."""
    train_files, held_out = shard_files(features, "train"), shard_files(features, "held_out")
    if not train_files:
        raise SpecDecodeError(f"{features} holds no training features")
    listing = [f"{p.parent.name}/{p.name}" for p in train_files + held_out]
    if any(seen != listing for seen in gathered(listing)):  # every rank sees every rank's listing: all fail alike
        raise SpecDecodeError(f"the ranks see different shards in {features}: across hosts, --features and --out "
                              "must be on a filesystem every host reads")
    return train_files, held_out


def _check_resumable(checkpoint: Path, state: dict | None, made_with: dict) -> None:
    """A checkpoint resumes only the run that made it: the same settings and data."""
    if state is not None and state["made_with"] != made_with:
        changed = sorted(k for k in made_with if state["made_with"].get(k) != made_with[k])
        raise SpecDecodeError(f"{checkpoint} was made with other settings ({', '.join(changed)}); use another "
                              "--out or the same settings")


def data_order(files: list[Path], epochs: int, seed: int) -> list[Path]:
    """Every epoch's shuffle of the training shards, one after the other: step s takes the s-th batch of it,
    whatever the number of ranks, so a run resumes at its step on any number of them."""
    return [path for epoch in range(epochs) for path in _shuffled(files, seed + epoch)]


def _write_result(trainee: Trainee, build: Callable[[torch.Tensor], Trainee], draft_ids: torch.Tensor,
                  objective: Objective, optimizer, out: Path, ranks: Ranks) -> None:
    """Rank 0 writes the trained drafter; a sharded one is first gathered whole into a new drafter of its own."""
    if sharded(objective):
        head, _ = full_state(objective, optimizer)
        if ranks.main:
            whole = build(draft_ids)
            whole.module.load_state_dict(head)
            whole.save(out)
    elif ranks.main:
        trainee.save(out)
    wait_for_all()  # no rank leaves before the result is written


@torch.no_grad()
def evaluate(objective: Callable[[Shard, torch.Tensor], UnrollResult], files: list[Path],
             target_to_draft: torch.Tensor, settings: TrainSettings, autocast) -> dict[str, list[float]]:
    """Per held-out kind (TrainingText.kind: "answer" and "chat", the target's own answers to standard-library
    tasks and to chat-like prompts; "code", teacher-forced code) and draft position,
    how often the drafter's draft is the target's own next token (draft position k's acceptance given the drafts
    before it were right; a next token outside the draft vocabulary counts as a miss). On several ranks each
    measures its share of the files and the counts are added: every file is measured once."""
    mine: dict[str, tuple[list[int], list[int]]] = {}  # kind -> (correct, counted) per draft position
    for path in current_ranks().share(files):
        shard = _to(load_shard(path), settings.device)
        with autocast:
            result = objective(shard, target_to_draft)
        so_far = mine.get(shard_kind(path))
        mine[shard_kind(path)] = (_added(so_far and so_far[0], result.correct),
                                  _added(so_far and so_far[1], result.counted))
    correct: dict[str, list[int]] = {}
    counted: dict[str, list[int]] = {}
    for rank_counts in gathered(mine):  # every rank's, in rank order: the same sums on every rank
        for kind, (rank_correct, rank_counted) in rank_counts.items():
            correct[kind] = _added(correct.get(kind), rank_correct)
            counted[kind] = _added(counted.get(kind), rank_counted)
    return {kind: [c / max(n, 1) for c, n in zip(correct[kind], counted[kind])] for kind in sorted(correct)}


def _added(total: list[int] | None, more: list[int]) -> list[int]:
    return list(more) if total is None else [a + b for a, b in zip(total, more)]


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


def _made_with(kind: str, settings: TrainSettings, batch: int, files: list[Path]) -> dict:
    """What a resumed run must share with the run it continues (the device, the number of ranks and the
    sharding may change: cpu to cuda, 8 GPUs to 2)."""
    fields = asdict(settings)
    del fields["device"], fields["fsdp"]
    return {"kind": kind, **fields, "batch": batch, "shards": [f"{p.parent.name}/{p.name}" for p in files]}

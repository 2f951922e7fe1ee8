"""Train an EAGLE-3 head for a target on this machine: features once (features.py), then epochs of the
training-time test (ttt.py) with acceptance measured on held-out text as it goes; resumable; the result is
written in the reference layout that vLLM and SGLang read (eagle3_checkpoint.save_eagle3_head)."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specdecode.errors import SpecDecodeError
from specdecode.models.eagle3_head import Eagle3Config, Eagle3Head
from specdecode.models.formats.eagle3_checkpoint import save_eagle3_head
from specdecode.models.loader import LoadedModel
from specdecode.models.model_config import ModelConfig
from specdecode.training.features import Shard, load_shard, shard_files
from specdecode.training.ttt import unroll

CHECKPOINT = "checkpoint.pt"


@dataclass(frozen=True)
class TrainSettings:
    draft_vocab: int = 32000  # the most frequent target tokens of the training data
    intermediate_size: int | None = None  # the head's MLP width (None: the target's)
    steps: int = 3  # unrolled draft steps (training-time test)
    epochs: int = 2
    lr: float = 3e-4
    warmup: float = 0.05  # share of the steps with a linearly rising learning rate
    eval_every: int = 100  # optimizer steps between held-out measurements (and checkpoints)
    seed: int = 0
    device: str = "cpu"


def default_layer_ids(num_layers: int) -> tuple[int, ...]:
    """The reference's boundaries (2, L//2, L-3), made distinct and in range for shallow models."""
    ids = sorted({min(max(i, 0), num_layers) for i in (2, num_layers // 2, num_layers - 3)})
    return tuple(ids) if len(ids) == 3 else tuple(range(max(num_layers - 2, 0), num_layers + 1))


def draft_vocabulary(files: list[Path], size: int, vocab: int) -> torch.Tensor:
    """The `size` most frequent target ids among the tokens and the target's own next tokens, ascending (as the
    reference sorts its used tokens) -> [Vd] long."""
    counts = torch.zeros(vocab, dtype=torch.long)  # [V]
    for path in files:
        shard = load_shard(path)
        counts += torch.bincount(shard.tokens, minlength=vocab) + torch.bincount(shard.top_ids[:, 0], minlength=vocab)
    size = min(size, vocab)
    return counts.topk(size).indices.sort().values


def output_rows(target: LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    """The target output head's rows for `ids` [Vd] -> [Vd, H] float32, whatever the head's storage: its output on
    the identity matrix is its weight (one-hot rows quantize exactly to int8, so this holds for w4a8 too)."""
    model = target.model
    hidden = model.config.hidden_size
    with torch.inference_mode():
        eye = torch.eye(hidden, dtype=model.dtype, device=model.device)  # [H, H]
        columns = torch.cat([model.lm_head(eye[i : i + 256])[:, ids.to(model.device)] for i in range(0, hidden, 256)])
    return columns.T.float().contiguous()  # [Vd, H]


def new_head(target: LoadedModel, layer_ids: tuple[int, ...], draft_ids: torch.Tensor,
             settings: TrainSettings) -> Eagle3Head:
    """A head for the target: the target's attention shape and rope, its output rows and final norm as the
    start of lm_head and norm (the head then starts as the target's own last step), the rest random."""
    tc = target.config
    layer = ModelConfig(architecture="llama", vocab_size=tc.vocab_size, hidden_size=tc.hidden_size,
                        intermediate_size=settings.intermediate_size or tc.intermediate_size, num_layers=1,
                        num_heads=tc.num_heads, num_kv_heads=tc.num_kv_heads, head_dim=tc.head_dim,
                        rms_norm_eps=tc.rms_norm_eps, rope_theta=tc.rope_theta, rope_scaling=tc.rope_scaling,
                        max_position_embeddings=tc.max_position_embeddings)
    config = Eagle3Config(layer=layer, target_hidden_size=tc.hidden_size, draft_vocab_size=draft_ids.numel(),
                          layer_ids=layer_ids)
    torch.manual_seed(settings.seed)
    head = Eagle3Head(config, target.model.embed)
    with torch.no_grad():
        head.lm_head.weight.copy_(output_rows(target, draft_ids))
        head.norm.weight.copy_(target.model.norm.weight.float())
    head.draft_to_target = draft_ids.clone()
    return head.to(settings.device)


def train_eagle3(target: LoadedModel, features: Path, out: Path, settings: TrainSettings,
                 quiet: bool = False, on_eval: Callable[[int, int, list[float]], None] | None = None) -> dict:
    """Train on the shards in `features` and write the head to `out` -> the last held-out measurement."""
    manifest = json.loads((features / "manifest.json").read_text())
    layer_ids = tuple(manifest["layer_ids"])
    train_files, held_out = shard_files(features, "train"), shard_files(features, "held_out")
    if not train_files:
        raise SpecDecodeError(f"{features} holds no training features")
    target.model.requires_grad_(False)  # frozen: its embedding feeds the head, and no gradient should reach it
    checkpoint = out / CHECKPOINT
    made_with = {**_resume_settings(settings), "layer_ids": list(layer_ids),
                 "shards": [f"{p.parent.name}/{p.name}" for p in train_files + held_out]}
    state = None
    if checkpoint.exists():  # our own file, written below; weights_only refuses anything but tensors and data
        state = torch.load(checkpoint, map_location=settings.device, weights_only=True)
        changed = sorted(k for k in made_with if state["made_with"].get(k) != made_with[k])
        if changed:  # resuming on other data or settings would skip or repeat sequences
            raise SpecDecodeError(f"{checkpoint} was made with other settings ({', '.join(changed)}); use another "
                                  "--out or the same settings")
        draft_ids = state["draft_ids"]
    else:
        draft_ids = draft_vocabulary(train_files, settings.draft_vocab, target.config.vocab_size)
    head = new_head(target, layer_ids, draft_ids, settings)
    lengths = {p: load_shard(p).tokens.numel() for p in train_files + held_out}  # read once, used twice
    head.finish_loading(max(lengths.values()) + 8)
    trainable = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
    total = settings.epochs * len(train_files)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, total, settings.warmup))
    step = 0
    if state is not None:
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        step = state["step"]
    target_to_draft = torch.full((target.config.vocab_size,), -1, dtype=torch.long, device=settings.device)  # [V]
    target_to_draft[draft_ids.to(settings.device)] = torch.arange(draft_ids.numel(), device=settings.device)
    autocast = torch.autocast(device_type=torch.device(settings.device).type, dtype=torch.bfloat16,
                              enabled=_bf16_fast(settings.device))
    order = [path for epoch in range(settings.epochs) for path in _shuffled(train_files, settings.seed + epoch)]
    measured = evaluate(head, held_out, target_to_draft, settings, autocast) if step == 0 else state["measured"]
    tokens_seen = sum(lengths[p] for p in order[:step])  # for the learning curve
    bar = tqdm(total=total, initial=step, unit="seq", desc="training eagle3", disable=quiet)
    bar.set_postfix_str(_describe(measured))
    if on_eval is not None and step == 0:
        on_eval(step, 0, measured)
    for path in order[step:]:
        shard = _to(load_shard(path), settings.device)
        with autocast:
            result = unroll(head, shard.tokens, shard.hidden, shard.top_ids, shard.top_logprobs, shard.loss_mask,
                            target_to_draft, settings.steps)
        optimizer.zero_grad(set_to_none=True)
        result.loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 0.5)
        optimizer.step()
        schedule.step()
        step += 1
        tokens_seen += shard.tokens.numel()
        bar.update(1)
        if step % settings.eval_every == 0 or step == total:
            measured = evaluate(head, held_out, target_to_draft, settings, autocast)
            _save_checkpoint(checkpoint, head, optimizer, schedule, step, draft_ids, made_with, measured)
            if on_eval is not None:
                on_eval(step, tokens_seen, measured)
        bar.set_postfix_str(f"loss {result.loss.item():.3f} | {_describe(measured)}")
    bar.close()
    save_eagle3_head(head, out, target.config)
    return {"held_out_accuracy": measured, "steps": step, "draft_vocab": draft_ids.numel()}


@torch.no_grad()
def evaluate(head: Eagle3Head, files: list[Path], target_to_draft: torch.Tensor, settings: TrainSettings,
             autocast) -> list[float]:
    """Per unrolled step, how often the head's draft is the target's own next token on held-out text (draft
    position k's acceptance given the drafts before it were right; a next token outside the draft vocabulary
    counts as a miss)."""
    correct, counted = [0] * settings.steps, [0] * settings.steps
    for path in files:
        shard = _to(load_shard(path), settings.device)
        with autocast:
            result = unroll(head, shard.tokens, shard.hidden, shard.top_ids, shard.top_logprobs, shard.loss_mask,
                            target_to_draft, settings.steps)
        correct = [a + b for a, b in zip(correct, result.correct)]
        counted = [a + b for a, b in zip(counted, result.counted)]
    return [c / max(n, 1) for c, n in zip(correct, counted)]


def expected_accepted(accuracy: list[float]) -> float:
    """Mean tokens per target step of a chain this long, from the per-position rates (bonus token included)."""
    total, survive = 1.0, 1.0
    for rate in accuracy:
        survive *= rate
        total += survive
    return total


def _describe(accuracy: list[float]) -> str:
    rates = "/".join(f"{a:.2f}" for a in accuracy)
    return f"held-out acceptance {rates} (~{expected_accepted(accuracy):.2f} tokens/step)"


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


def _bf16_fast(device: str) -> bool:
    from specdecode.models.loader import resolve_dtype

    return resolve_dtype("auto", device) == torch.bfloat16


def _resume_settings(settings: TrainSettings) -> dict:
    """What a resumed run must share with the run it continues (the device may change: cpu to cuda)."""
    fields = asdict(settings)
    del fields["device"]
    return fields


def _save_checkpoint(path: Path, head: Eagle3Head, optimizer, schedule, step: int, draft_ids: torch.Tensor,
                     made_with: dict, measured: list[float]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"head": head.state_dict(), "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(),
             "step": step, "draft_ids": draft_ids, "made_with": made_with, "measured": measured}
    torch.save(state, path.with_suffix(".partial"))
    path.with_suffix(".partial").replace(path)

"""The target's features of the training text, computed once and kept on disk, reused across epochs and drafter
kinds (on 2 CPU cores a 1.5B w4a8 target yields about 230 tokens/s of features of code and 60 tokens/s of its own
answers of up to 384 tokens, written 8 at a time, then read: the slow two thirds of the default hour).

Each shard is one safetensors file of one sequence, named ORDINAL-KIND ("answer": a standard-library task and the
target's own answer; "chat": a chat-like prompt (training/chat_tasks.py) and its answer; "code": teacher-forced
source; held-out acceptance is measured on each kind apart): the tokens, the
hidden states at the boundary ids asked for (bf16), the target's top-k next-token log-probabilities at every
position (the soft labels: enough of the mass for distillation at a fraction of a full vocabulary row), and which
positions count in the loss (an answer's tokens, not the prompt's). Shards are written whole (a temporary name,
then a rename), so an interrupted run resumes where it stopped; a manifest says what the folder holds and must
match on resume.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from specdecode.errors import SpecDecodeError
from specdecode.models.loader import LoadedModel
from specdecode.training.data import TrainingText
from specdecode.training.ranks import Ranks

TOP_K = 32
MANIFEST = "manifest.json"


@dataclass
class Shard:
    tokens: torch.Tensor  # [T] long
    hidden: torch.Tensor  # [T, n_aux * H] bf16, the boundary states concatenated in ascending id order
    top_ids: torch.Tensor  # [T, K] long: the target's K likeliest next tokens at each position
    top_logprobs: torch.Tensor  # [T, K] float32
    loss_mask: torch.Tensor  # [T] bool: position t's next token is one the drafter should learn


def shard_files(folder: Path, split: str) -> list[Path]:
    return sorted((folder / split).glob("*.safetensors"))


def load_shard(path: Path) -> Shard:
    tensors = load_file(str(path))
    return Shard(tensors["tokens"].long(), tensors["hidden"], tensors["top_ids"].long(),
                 tensors["top_logprobs"].float(), tensors["loss_mask"].bool())


def check_manifest(folder: Path, manifest: dict) -> None:
    """Write the manifest of a new feature folder, or fail if an existing one was made differently in what
    `manifest` names. Folders of other versions stay usable: a setting no longer written no longer matters, and one
    an older version did not write was off (matches a new value of False or 0)."""
    path = folder / MANIFEST
    if path.exists():
        try:
            existing = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise SpecDecodeError(f"cannot read {path} ({error}); delete the features folder to start it again"
                                  ) from None
        changed = sorted(key for key, value in manifest.items()
                         if (existing[key] != value if key in existing else bool(value)))  # unwritten: was off
        if changed:
            raise SpecDecodeError(f"{folder} holds features made with other settings ({', '.join(changed)}); "
                                  "use another --out or the same settings")
        return
    folder.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")  # whole or absent, like the shards
    partial.write_text(json.dumps(manifest, indent=1))
    partial.replace(path)


def shard_ordinal(path: Path) -> int:
    """The ordinal of a shard's text in its split, from its name (ORDINAL-KIND.safetensors)."""
    return int(path.stem.split("-", 1)[0])


def share_of(tokens: int, ranks: Ranks) -> int:
    """A rank's part of a token budget: the parts of all ranks add up to it."""
    return tokens * (ranks.rank + 1) // ranks.world - tokens * ranks.rank // ranks.world


def shard_kind(path: Path) -> str:
    """The kind of text a shard holds ("answer", "chat" or "code", as TrainingText.kind), from its name
    (ORDINAL-KIND.safetensors)."""
    return path.stem.rsplit("-", 1)[-1]


def write_shard(model, path: Path, ids: list[int], loss_from: int, layer_ids: tuple[int, ...]) -> None:
    """One sequence's features, written whole: loss on positions from `loss_from` on."""
    tokens = torch.tensor([ids], device=model.device)  # [1, T]
    out = model(tokens, torch.arange(len(ids), device=model.device).unsqueeze(0), model.new_cache(len(ids)),
                hidden_layers=layer_ids)
    log_probs = torch.log_softmax(out.logits[0].float(), dim=-1)  # [T, V]
    top_logprobs, top_ids = log_probs.topk(TOP_K, dim=-1)  # [T, K] each
    loss_mask = torch.zeros(len(ids), dtype=torch.bool)  # [T]
    loss_mask[loss_from:] = True
    shard = {"tokens": tokens[0].int().cpu(), "loss_mask": loss_mask,
             "hidden": torch.cat([out.hidden[i][0] for i in sorted(layer_ids)], dim=-1).bfloat16().cpu(),
             "top_ids": top_ids.int().cpu(), "top_logprobs": top_logprobs.cpu()}
    save_file(shard, str(path.with_suffix(".partial")))
    path.with_suffix(".partial").replace(path)


@torch.inference_mode()
def extract(target: LoadedModel, layer_ids: tuple[int, ...], texts: Iterable[TrainingText], folder: Path,
            token_budget: dict[tuple[str, str], int], answer_tokens: int, max_len: int, quiet: bool = False,
            ranks: Ranks = Ranks()) -> dict[tuple[str, str], int]:
    """Write a shard per sequence into folder/train and folder/held_out until each (split, kind)'s token budget
    is met: a prompt becomes the chat-templated prompt and the target's own greedy answer (loss on the answer;
    prompts are answered ANSWER_GROUP at a time), code stays as it is (loss everywhere). A shard is named by its
    text's ordinal in its split, so a rerun skips what an earlier run wrote (texts come in a fixed order).

    Over several ranks, each owns the texts whose ordinal is its rank modulo the world size and fills its share
    of each budget with them: no text is computed twice, none a rank needs is skipped, and a rerun on another
    number of ranks counts each written shard once (for its new owner). -> this rank's tokens per (split, kind)."""
    from specdecode.training.answers import ANSWER_GROUP, Answerer

    answerer = Answerer(target, answer_tokens)
    token_budget = {key: share_of(tokens, ranks) for key, tokens in token_budget.items()}
    done = dict.fromkeys(token_budget, 0)
    for split, kind in token_budget:
        (folder / split).mkdir(parents=True, exist_ok=True)
        for path in shard_files(folder, split):
            if shard_kind(path) == kind and shard_ordinal(path) % ranks.world == ranks.rank:
                done[split, kind] += int(load_file(str(path))["tokens"].numel())
    total = sum(token_budget.values())
    bar = tqdm(total=total, initial=min(total, sum(done.values())), unit="tok", desc="target features",
               disable=quiet or not ranks.main)  # rank 0's share stands for every rank's
    ordinal = {split: -1 for split, _ in token_budget}
    pending: list[tuple[Path, tuple[str, str], list[int]]] = []  # prompts waiting for their answers

    def write(path: Path, key: tuple[str, str], ids: list[int], loss_from: int) -> None:
        if len(ids) < 4:
            return
        write_shard(target.model, path, ids, loss_from, layer_ids)
        done[key] += len(ids)
        bar.update(len(ids))

    def answer_pending() -> None:
        answers = answerer.answer([prompt for _, _, prompt in pending])
        for (path, key, prompt), answer in zip(pending, answers):
            write(path, key, (prompt + answer)[:max_len], len(prompt) - 1)  # the prompt's last row predicts it
        pending.clear()

    for text in texts:
        if all(done[key] >= token_budget[key] for key in token_budget):
            break
        key = ("held_out" if text.held_out else "train", text.kind)
        if key not in token_budget:
            continue
        ordinal[key[0]] += 1
        if ordinal[key[0]] % ranks.world != ranks.rank:  # another rank's text
            continue
        queued = sum(len(prompt) + answer_tokens for _, queued_key, prompt in pending if queued_key == key)
        if pending and done[key] + queued >= token_budget[key]:  # what waits may meet the budget: answer it first
            answer_pending()
        if done[key] >= token_budget[key]:
            continue
        path = folder / key[0] / f"{ordinal[key[0]]:06d}-{key[1]}.safetensors"
        if path.exists():  # written by an earlier run
            continue
        if not text.is_prompt:
            write(path, key, target.tokenizer.encode(text.text)[:max_len], 0)
            continue
        prompt = answerer.prompt_ids(text.text)
        if prompt is None or len(prompt) > max_len // 2:  # no room for its answer: skipped
            continue
        pending.append((path, key, prompt))
        if len(pending) == ANSWER_GROUP:
            answer_pending()
    if pending:
        answer_pending()
    bar.close()
    return done

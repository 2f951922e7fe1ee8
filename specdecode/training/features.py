"""The target's features of the training text, computed once and kept on disk, reused across epochs and drafter
kinds (on 2 CPU cores a 1.5B target yields about 200 tokens/s of features: the slow half of training).

Each shard is one safetensors file of one sequence: the tokens, the hidden states at the boundary ids asked for
(bf16), the target's top-k next-token log-probabilities at every position (the soft labels: enough of the mass
for distillation at a fraction of a full vocabulary row), and which positions count in the loss (an answer's
tokens, not the prompt's). Shards are written whole (a temporary name, then a rename), so an interrupted run
resumes where it stopped; a manifest says what the folder holds and must match on resume.
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
    """Write the manifest of a new feature folder, or fail if an existing one was made differently."""
    path = folder / MANIFEST
    if path.exists():
        try:
            existing = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise SpecDecodeError(f"cannot read {path} ({error}); delete the features folder to start it again"
                                  ) from None
        if existing != manifest:
            changed = sorted(k for k in manifest if existing.get(k) != manifest[k])
            raise SpecDecodeError(f"{folder} holds features made with other settings ({', '.join(changed)}); "
                                  "use another --out or the same settings")
        return
    folder.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")  # whole or absent, like the shards
    partial.write_text(json.dumps(manifest, indent=1))
    partial.replace(path)


def token_ids(engine, text: TrainingText, answer_tokens: int, max_len: int) -> tuple[list[int], int]:
    """(token ids, first position whose next token is learnt): a prompt through the chat template plus the
    target's own greedy answer (loss on the answer), or code as it is (loss everywhere)."""
    from specdecode.config import SamplingParams

    if not text.is_prompt:
        return engine.target.tokenizer.encode(text.text)[:max_len], 0
    prompt = engine.target.tokenizer.encode_chat([{"role": "user", "content": text.text}])
    if len(prompt) > max_len // 2:  # cut, it would lose the chat template's assistant turn: skipped instead
        return [], 0
    answer = engine.complete(prompt, SamplingParams(max_tokens=answer_tokens)).token_ids
    return (prompt + answer)[:max_len], len(prompt) - 1  # the prompt's last position predicts the answer


@torch.inference_mode()
def extract(target: LoadedModel, layer_ids: tuple[int, ...], texts: Iterable[TrainingText], folder: Path,
            token_budget: dict[str, int], answer_tokens: int, max_len: int, quiet: bool = False) -> dict[str, int]:
    """Write a shard per sequence into folder/train and folder/held_out until each split's token budget is met.
    A shard is named by its text's ordinal in its split, so a rerun skips what an earlier run wrote (texts come
    in a fixed order). -> tokens per split."""
    from specdecode.config import SpecConfig
    from specdecode.engine.engine import Engine

    engine = Engine(target, spec=SpecConfig("ngram"))  # answers: lossless, and faster than plain on code
    done = {split: sum(int(load_file(str(p))["tokens"].numel()) for p in shard_files(folder, split))
            for split in token_budget}
    for split in token_budget:
        (folder / split).mkdir(parents=True, exist_ok=True)
    total = sum(token_budget.values())
    bar = tqdm(total=total, initial=min(total, sum(done.values())), unit="tok", desc="target features",
               disable=quiet)
    ordinal = {split: -1 for split in token_budget}
    model = target.model
    for text in texts:
        if all(done[s] >= token_budget[s] for s in token_budget):
            break
        split = "held_out" if text.held_out else "train"
        if split not in token_budget or done[split] >= token_budget[split]:
            continue
        ordinal[split] += 1
        path = folder / split / f"{ordinal[split]:06d}.safetensors"
        if path.exists():  # written by an earlier run
            continue
        ids, loss_from = token_ids(engine, text, answer_tokens, max_len)
        if len(ids) < 4:
            continue
        tokens = torch.tensor([ids], device=model.device)  # [1, T]
        out = model(tokens, torch.arange(len(ids), device=model.device).unsqueeze(0), model.new_cache(len(ids)),
                    hidden_layers=layer_ids)
        log_probs = torch.log_softmax(out.logits[0].float(), dim=-1)  # [T, V]
        top_logprobs, top_ids = log_probs.topk(TOP_K, dim=-1)  # [T, K] each
        loss_mask = torch.zeros(len(ids), dtype=torch.bool)
        loss_mask[loss_from:] = True
        shard = {"tokens": tokens[0].int().cpu(), "loss_mask": loss_mask,
                 "hidden": torch.cat([out.hidden[i][0] for i in sorted(layer_ids)], dim=-1).bfloat16().cpu(),
                 "top_ids": top_ids.int().cpu(), "top_logprobs": top_logprobs.cpu()}
        save_file(shard, str(path.with_suffix(".partial")))
        path.with_suffix(".partial").replace(path)
        done[split] += len(ids)
        bar.update(len(ids))
    bar.close()
    return done

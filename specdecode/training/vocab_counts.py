"""Which tokens a target emits most, counted over its own greedy answers to the offline prompts (training/data.py):
the rows a draft model's reduced output head keeps (`draft_vocab`, models/heads/draft_vocab.py), where the lowest
ids of a byte-level BPE vocabulary are only a guess at what is frequent. `specdecode train vocab` writes them."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm import tqdm

from specdecode.models.heads.draft_vocab import COUNTS_FILE
from specdecode.models.loader import LoadedModel


def count_answers(target: LoadedModel, answers: int, answer_tokens: int,
                  quiet: bool = False) -> tuple[torch.Tensor, int]:
    """How often the target emits each token [V] long over its greedy answers to `answers` prompts spread through
    the standard library's modules (held-out modules left out, as training does), and how many it answered (a
    prompt with no room for its answer in the target's context is skipped)."""
    from specdecode.config import SamplingParams, SpecConfig
    from specdecode.engine.engine import Engine
    from specdecode.training.data import prompts

    every = [text for text in prompts() if not text.held_out]
    chosen = every[:: max(1, len(every) // answers)][:answers]
    engine = Engine(target, spec=SpecConfig("ngram"))  # lossless, and faster than plain decoding on code
    counts = torch.zeros(target.config.vocab_size, dtype=torch.long)  # [V]
    answered = 0
    for text in tqdm(chosen, desc="the target's answers", unit="answer", disable=quiet):
        prompt = target.tokenizer.encode_chat([{"role": "user", "content": text.text}])
        if len(prompt) + answer_tokens > engine.context_limit:
            continue
        answer = engine.complete(prompt, SamplingParams(max_tokens=answer_tokens)).token_ids
        counts += torch.bincount(torch.tensor(answer, dtype=torch.long), minlength=counts.numel())[: counts.numel()]
        answered += 1
    return counts, answered


def write_counts(folder: Path, counts: torch.Tensor, target: LoadedModel, answers: int) -> Path:
    """counts [V] -> FOLDER/token_counts.json (the seen ids and their counts), written whole or not at all."""
    seen = counts.nonzero().flatten()  # [S]
    record = {"target": target.name, "answers": answers, "tokens": int(counts.sum()),
              "vocab_size": counts.numel(), "counts": dict(zip(map(str, seen.tolist()), counts[seen].tolist()))}
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / (COUNTS_FILE + ".partial")
    partial.write_text(json.dumps(record))
    partial.replace(folder / COUNTS_FILE)
    return folder / COUNTS_FILE

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
    the standard library's modules (held-out modules left out, as training does), answered together
    (training/answers.py), and how many it answered (a prompt with no room for its answer in the target's context
    is skipped)."""
    from specdecode.training.answers import ANSWER_GROUP, Answerer
    from specdecode.training.data import prompts

    every = [text for text in prompts() if not text.held_out]
    chosen = every[:: max(1, len(every) // answers)][:answers]
    answerer = Answerer(target, answer_tokens)
    fitting = [ids for ids in (answerer.prompt_ids(text.text) for text in chosen) if ids is not None]
    counts = torch.zeros(target.config.vocab_size, dtype=torch.long)  # [V]
    bar = tqdm(total=len(fitting), desc="the target's answers", unit="answer", disable=quiet)
    for start in range(0, len(fitting), ANSWER_GROUP):
        for answer in answerer.answer(fitting[start : start + ANSWER_GROUP]):
            counts += torch.bincount(torch.tensor(answer, dtype=torch.long), minlength=counts.numel())[: counts.numel()]
            bar.update(1)
    bar.close()
    return counts, len(fitting)


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

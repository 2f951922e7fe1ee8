"""Why a greedy output diverged from plain decoding: was the target's choice a near-tie at that token?

Speculative verification scores several tokens in one forward, so its matrix products sum in a different
order than plain decoding's one-token forwards; in bf16 that moves logits by a few units in the last place.
Where the target's top two logits are that close, either token is a faithful greedy choice.
"""

from __future__ import annotations

import torch

from specdecode.bench.datasets import Question
from specdecode.engine.engine import Engine

# Top-2 logit gap (in logits) under which a divergence counts as a near-tie: a few bf16 ulps at logit ~20.
NEAR_TIE_GAP = 0.25


def top2_gap(engine: Engine, question: Question, reference_ids: list[list[int]], position: int) -> float:
    """The target's top-1 minus top-2 logit when predicting token `position` of the reference output."""
    turn, offset = _locate(reference_ids, position)
    tokenizer = engine.target.tokenizer
    messages: list[dict] = []
    for index in range(turn + 1):
        messages.append({"role": "user", "content": question.turns[index]})
        if index < turn:
            messages.append({"role": "assistant", "content": tokenizer.decode(reference_ids[index])})
    prefix = engine.encode(messages) + reference_ids[turn][:offset]
    model = engine.target.model
    with torch.inference_mode():
        logits = model(torch.tensor([prefix], device=model.device),
                       torch.arange(len(prefix), device=model.device).unsqueeze(0),
                       model.new_cache(len(prefix)), logits_at=slice(-1, None)).logits[0, -1]  # [V]
    top = torch.topk(logits, 2).values  # [2]
    return float(top[0] - top[1])


def _locate(ids: list[list[int]], position: int) -> tuple[int, int]:
    """Flat token position -> (turn index, offset within that turn)."""
    for turn, turn_ids in enumerate(ids):
        if position < len(turn_ids):
            return turn, position
        position -= len(turn_ids)
    return len(ids) - 1, len(ids[-1])

"""Chat prompts the target writes itself (Magpie, Xu et al. 2024): its chat template up to where a user's message
begins, sampled on (temperature 0.8) until the end of the turn, is what the target thinks users ask. No public
benchmark goes in, so none can leak into training; the answers to these prompts are chat-like training data
beside the standard library's tasks (training/data.py).

A prompt is kept when it ended by itself (not cut at the token cap), has a few words, does not go on to answer
itself (a small target often writes "Q: ... A: ..." as the user), and is not a near-copy of one kept before (the
same first words). The prompts are written to a file once and read back on resume, so the training texts keep
their order. Measured on the 1.5B default target: about 3 seconds per kept prompt on 2 cores, and many are noisy
(questions about itself, both sides of a dialogue), which is why `specdecode train` leaves them off by default."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tqdm import tqdm

from specdecode.config import SamplingParams
from specdecode.errors import SpecDecodeError
from specdecode.models.loader import LoadedModel
from specdecode.training.answers import Answerer
from specdecode.training.data import TrainingText

SENTINEL = "SELF-PROMPT-SENTINEL"  # a user message whose text marks where the template's user prefix ends
PROMPT_TOKENS = 128  # a written prompt's cap: one that runs past it is dropped
TEMPERATURE = 0.8
ANSWER_MARKS = re.compile(r"^\s*(A|Answer|Assistant|答)\s*[:：]", re.MULTILINE | re.IGNORECASE)
MIN_WORDS = 4
SAME_START_WORDS = 6  # prompts beginning with the same words count as one
PROMPTS_FILE = "self_prompts.jsonl"


def user_prefix(answerer: Answerer) -> list[int]:
    """The chat template's ids before a user message's text: what the target continues into a prompt."""
    tokenizer = answerer.engine.target.tokenizer
    if not tokenizer.has_chat_template:
        raise SpecDecodeError("chat prompts need the target's chat template; this target has none")
    text = tokenizer.hf.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False,
                                            add_generation_prompt=True)
    return tokenizer.hf.encode(text[: text.index(SENTINEL)], add_special_tokens=False)


def _start(text: str) -> str:
    return " ".join(re.findall(r"\w+", text.lower())[:SAME_START_WORDS])


def write_prompts(answerer: Answerer, count: int, batch: int, quiet: bool = False) -> list[str]:
    """`count` distinct prompts (fewer when the target keeps repeating itself: after 4 x count tries it stops),
    sampled `batch` at a time with seeds 0, 1, 2, ... (the same prompts on every run of the same target)."""
    prefix = user_prefix(answerer)
    tokenizer = answerer.engine.target.tokenizer
    kept: list[str] = []
    starts: set[str] = set()
    bar = tqdm(total=count, unit="prompt", desc="the target's own prompts", disable=quiet)
    seed = 0
    while len(kept) < count and seed < 4 * count:
        samplings = [SamplingParams(temperature=TEMPERATURE, max_tokens=PROMPT_TOKENS, seed=seed + i)
                     for i in range(batch)]
        seed += batch
        for ids, ended in answerer.complete([prefix] * batch, samplings):
            text = tokenizer.decode(ids).strip()
            if not ended or len(text.split()) < MIN_WORDS or ANSWER_MARKS.search(text) or _start(text) in starts \
                    or len(kept) == count:
                continue
            starts.add(_start(text))
            kept.append(text)
            bar.update(1)
    bar.close()
    return kept


def self_prompts(target: LoadedModel, folder: Path, count: int, batch: int, quiet: bool = False
                 ) -> list[TrainingText]:
    """The target's own prompts, written to folder/self_prompts.jsonl the first time (read back after), as training
    texts; each is held out or not by a hash of its ordinal's name, as modules are."""
    path = folder / PROMPTS_FILE
    if path.exists():
        texts = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
    else:
        texts = write_prompts(Answerer(target, PROMPT_TOKENS), count, batch, quiet)
        partial = path.with_suffix(".partial")
        partial.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in texts))
        partial.replace(path)
    return [TrainingText(f"self-prompt-{i}", text, True) for i, text in enumerate(texts)]

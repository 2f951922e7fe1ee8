"""The target's own greedy answers to many prompts at once, the training data that looks like use: requests
stepped together through the engine's batched step (Engine.step_many, one target forward for all of them), which
on 2 cores doubles one request's rate (54 -> 110 tokens/s at 8 requests, w4a8 1.5B target, with ngram drafting).

A batch's answers are what the target writes alone up to near-ties of a batched forward (engine.py, step_many):
the drafter learns the target's style either way, and the features are taken afterwards from one forward over
prompt and answer, so they are exactly the target's."""

from __future__ import annotations

from specdecode.config import SamplingParams, SpecConfig
from specdecode.engine.engine import Engine
from specdecode.models.loader import LoadedModel

ANSWER_BATCH = 8  # prompts answered together: twice one request's rate on 2 cores


class Answerer:
    """Answers chat prompts in batches with the target's decoding (ngram drafting: lossless, and faster than plain
    decoding on code)."""

    def __init__(self, target: LoadedModel, answer_tokens: int):
        self.engine = Engine(target, spec=SpecConfig("ngram"))
        self.answer_tokens = answer_tokens

    def prompt_ids(self, text: str) -> list[int] | None:
        """The chat-templated prompt, or None when it leaves no room for an answer in the target's context."""
        ids = self.engine.target.tokenizer.encode_chat([{"role": "user", "content": text}])
        return ids if len(ids) + self.answer_tokens <= self.engine.context_limit else None

    def answer(self, prompts: list[list[int]]) -> list[list[int]]:
        """Each prompt's greedy answer (at most answer_tokens ids, its end-of-turn token included), all stepped
        together."""
        sampling = SamplingParams(max_tokens=self.answer_tokens)
        return [ids for ids, _ in self.complete(prompts, [sampling] * len(prompts))]

    def complete(self, prompts: list[list[int]], samplings: list[SamplingParams]) -> list[tuple[list[int], bool]]:
        """Each prompt's continuation under its own sampling, all stepped together -> (ids, whether it ended by
        itself at an end-of-turn token rather than at its token cap)."""
        requests = [self.engine.begin(ids, sampling, reuse_prefix=False) for ids, sampling in zip(prompts, samplings)]
        for request in requests:
            while self.engine.prefill(request) is None:
                pass
        running = [request for request in requests if request.finish_reason is None]
        while running:
            self.engine.step_many(running)
            running = [request for request in running if request.finish_reason is None]
        for request in requests:
            self.engine.finish(request)
        return [(request.tokens[request.prompt_len :], request.finish_reason == "stop") for request in requests]

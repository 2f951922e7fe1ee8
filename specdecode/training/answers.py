"""The target's own greedy answers to many prompts at once, the training data that looks like use: requests
stepped together through the engine's batch (engine/batch.py, the loop the server runs too: one target forward
for all of them), which on 2 cores doubles one request's rate (54 -> 110 tokens/s at 8 requests, w4a8 1.5B
target, with ngram drafting).

Answers written together are what the target writes alone up to near-ties of a batched forward (engine.py,
step_many): the drafter learns the target's style either way, and the features are taken afterwards from one
forward over prompt and answer, so they are exactly the target's."""

from __future__ import annotations

from specdecode.config import SamplingParams, SpecConfig
from specdecode.engine.batch import RequestBatch
from specdecode.engine.engine import Engine
from specdecode.engine.request import Request
from specdecode.models.loader import LoadedModel

ANSWER_BATCH = 8  # requests stepped together: twice one request's rate on 2 cores
ANSWER_GROUP = 4 * ANSWER_BATCH  # prompts handed over at once, so that finished requests' places refill


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
        """Each prompt's greedy answer (at most answer_tokens ids, its end-of-turn token included)."""
        sampling = SamplingParams(max_tokens=self.answer_tokens)
        return [ids for ids, _ in self.complete(prompts, [sampling] * len(prompts))]

    def complete(self, prompts: list[list[int]], samplings: list[SamplingParams]) -> list[tuple[list[int], bool]]:
        """Each prompt's continuation under its own sampling -> (ids, whether it ended by itself at an end-of-turn
        token rather than at its token cap). ANSWER_BATCH requests step together, and a finished one's place is
        taken by the next prompt at once, so a long answer does not leave the others' places idle."""
        results: list[tuple[list[int], bool]] = [([], False)] * len(prompts)
        waiting = list(zip(range(len(prompts)), prompts, samplings))[::-1]  # popped from the end: in order
        batch = RequestBatch(self.engine, batched=True)
        index_of: dict[Request, int] = {}
        while waiting or len(batch):
            while waiting and len(batch) < ANSWER_BATCH:
                index, ids, sampling = waiting.pop()
                request = self.engine.begin(ids, sampling, reuse_prefix=False)
                index_of[request] = index
                batch.add(request)
            for item in batch.tick():
                if item.error is not None:
                    raise item.error
                if item.ended:
                    request = item.request
                    results[index_of.pop(request)] = (request.tokens[request.prompt_len :],
                                                      request.finish_reason == "stop")
        return results

"""The speculative loop: prefill, then propose -> verify in one target forward -> accept -> roll back -> commit.

`Engine.generate()` is the one iterator every front door (Python API, CLI, server, bench) shares.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from time import perf_counter

import torch

from specdecode.config import SamplingParams, SpecConfig
from specdecode.draft_length import DraftLength
from specdecode.drafters import DrafterContext, SequenceState, build_drafter
from specdecode.drafters.base import Drafter
from specdecode.drafters.draft_model import check_vocabularies
from specdecode.errors import SpecDecodeError
from specdecode.models.kv_cache import KVCache
from specdecode.models.loader import LoadedModel
from specdecode.stats import GenerationStats
from specdecode.tokenizer import IncrementalDetokenizer
from specdecode.verify import verify

Prompt = str | list[dict] | list[int]


@dataclass
class GenerationEvent:
    token_ids: list[int]  # ids committed since the previous event
    text: str  # text that became safe to show since the previous event
    finish_reason: str | None = None  # "stop" (end of turn or stop string) or "length" (max tokens / context)
    stats: GenerationStats | None = None  # on the last event only


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: GenerationStats


class Engine:
    def __init__(self, target: LoadedModel, draft: LoadedModel | None = None, spec: SpecConfig | None = None,
                 context_limit: int | None = None):
        self.target = target
        self.draft = draft
        self.spec = spec or SpecConfig()
        # The draft indexes its own rope table too, so the shorter of the two contexts bounds a request.
        model_limit = min(m.config.max_position_embeddings for m in (target, draft) if m is not None)
        self.context_limit = min(context_limit or model_limit, model_limit)
        if draft is not None:
            check_vocabularies(target, draft)
        self.check_spec(self.spec)

    def check_spec(self, spec: SpecConfig) -> None:
        """Fail before any work if the method is unknown or needs a model we do not have."""
        build_drafter(DrafterContext(spec, self.target, self.draft))  # cheap: drafters allocate in begin()

    def encode(self, prompt: Prompt, raw: bool = False) -> list[int]:
        """Text goes through the chat template when the model has one (unless raw); ids pass through."""
        tokenizer = self.target.tokenizer
        if isinstance(prompt, str):
            use_chat = tokenizer.has_chat_template and not raw
            ids = tokenizer.encode_chat([{"role": "user", "content": prompt}]) if use_chat else tokenizer.encode(prompt)
        elif prompt and isinstance(prompt[0], dict):
            ids = tokenizer.encode_chat(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise SpecDecodeError("the prompt is empty")
        if len(ids) >= self.context_limit:
            raise SpecDecodeError(
                f"the prompt has {len(ids)} tokens, which leaves no room in the context of {self.context_limit}"
            )
        return ids

    def generate(self, prompt: Prompt, sampling: SamplingParams | None = None, spec: SpecConfig | None = None,
                 raw: bool = False) -> Iterator[GenerationEvent]:
        sampling = sampling or SamplingParams()
        spec = spec or self.spec
        prompt_ids = self.encode(prompt, raw)
        drafter = build_drafter(DrafterContext(spec, self.target, self.draft))
        capacity = min(self.context_limit, len(prompt_ids) + sampling.max_tokens)
        generator = torch.Generator(device=self.target.model.device)
        generator.manual_seed(sampling.seed if sampling.seed is not None else random.getrandbits(63))
        seq = SequenceState(list(prompt_ids), len(prompt_ids), sampling, generator, capacity)
        cache = self.target.model.new_cache(capacity)
        stats = GenerationStats(method=spec.method, prompt_tokens=len(prompt_ids))
        detokenizer = IncrementalDetokenizer(self.target.tokenizer, sampling.stop)
        draft_length = DraftLength(spec.num_draft_tokens, spec.adaptive)
        eos = frozenset() if sampling.ignore_eos else self.target.tokenizer.eos_token_ids

        started = perf_counter()
        new_ids = self._prefill(seq, cache, drafter)
        stats.prefill_seconds = perf_counter() - started
        drafter.begin(seq)
        while True:
            new_ids, finish = self._finish(seq, new_ids, eos, capacity)
            text = detokenizer.add(new_ids)
            if detokenizer.stopped:
                # End at the token that completed the stop string, as plain decoding would.
                del seq.tokens[len(seq.tokens) - len(new_ids) + detokenizer.consumed :]
                new_ids, finish = new_ids[: detokenizer.consumed], "stop"
            if finish is None:
                yield GenerationEvent(new_ids, text)
                # A step commits up to k+1 tokens: never more than the budget or the context has room for.
                room = min(capacity - len(seq.tokens), sampling.max_tokens - self._made(seq))
                new_ids = self._step(seq, cache, drafter, min(draft_length.current, room - 1), stats, draft_length)
                continue
            stats.new_tokens = self._made(seq)
            stats.total_seconds = perf_counter() - started
            yield GenerationEvent(new_ids, text + detokenizer.flush(), finish, stats)
            return

    def complete(self, prompt: Prompt, sampling: SamplingParams | None = None, spec: SpecConfig | None = None,
                 raw: bool = False) -> GenerationResult:
        """Run generate() to the end and collect the result."""
        text, ids = [], []
        for event in self.generate(prompt, sampling, spec, raw):
            text.append(event.text)
            ids.extend(event.token_ids)
        return GenerationResult("".join(text), ids, event.finish_reason, event.stats)

    @torch.inference_mode()
    def _prefill(self, seq: SequenceState, cache: KVCache, drafter: Drafter) -> list[int]:
        device = self.target.model.device
        tokens = torch.tensor([seq.tokens], device=device)  # [1, P]
        positions = torch.arange(len(seq.tokens), device=device).unsqueeze(0)  # [1, P]
        out = self.target.model(tokens, positions, cache, hidden_layers=drafter.needs_hidden_layers,
                                logits_at=slice(-1, None))
        no_drafts = torch.empty(0, dtype=torch.long, device=device)  # [0]
        first = verify(no_drafts, None, out.logits[0], seq.sampling, seq.generator).next_token
        seq.tokens.append(first)
        return [first]

    @torch.inference_mode()
    def _step(self, seq: SequenceState, cache: KVCache, drafter: Drafter, k: int, stats: GenerationStats,
              draft_length: DraftLength) -> list[int]:
        began = perf_counter()
        proposal = drafter.propose(seq, k) if k > 0 else None
        drafted = proposal.tokens[:k] if proposal else []
        proposed = perf_counter()
        device = self.target.model.device
        start = len(seq.tokens) - 1  # the last committed token is not in the cache yet
        inputs = torch.tensor([[seq.tokens[-1], *drafted]], device=device)  # [1, K+1]
        positions = torch.arange(start, start + len(drafted) + 1, device=device).unsqueeze(0)  # [1, K+1]
        out = self.target.model(inputs, positions, cache, hidden_layers=drafter.needs_hidden_layers)  # [1, K+1, V]
        draft_probs = proposal.probs[: len(drafted)] if proposal and proposal.probs is not None else None
        result = verify(inputs[0, 1:], draft_probs, out.logits[0], seq.sampling, seq.generator)
        cache.truncate(start + 1 + result.num_accepted)
        committed = result.tokens
        seq.tokens.extend(committed)
        drafter.commit(seq, result)
        draft_length.update(len(drafted), result.num_accepted)
        stats.record_step(proposal.source if proposal else "", len(drafted), result.num_accepted, len(committed))
        stats.draft_seconds += proposed - began
        stats.verify_seconds += perf_counter() - proposed
        return committed

    @staticmethod
    def _made(seq: SequenceState) -> int:
        return len(seq.tokens) - seq.prompt_len

    def _finish(self, seq: SequenceState, new_ids: list[int], eos: frozenset[int], capacity: int
                ) -> tuple[list[int], str | None]:
        """Cut the newest ids after an end-of-turn token; say why generation ends, if it does.

        The draft length is capped so a step never passes the token budget or the context (see generate).
        """
        for i, token in enumerate(new_ids):
            if token in eos:
                del seq.tokens[len(seq.tokens) - len(new_ids) + i + 1 :]
                return new_ids[: i + 1], "stop"
        if self._made(seq) >= seq.sampling.max_tokens or len(seq.tokens) >= capacity:
            return new_ids, "length"
        return new_ids, None

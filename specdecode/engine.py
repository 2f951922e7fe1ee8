"""The speculative loop: start (prefill), then step (propose -> one target forward -> verify -> keep the
accepted path -> commit), then finish.

`Engine.generate()` is the one iterator every front door (Python API, CLI, server, bench) shares; `open` (or
`start`), `step` and `finish` are the same loop for callers that hold several requests (`Sequence`s) at once,
and `step_many` steps several of them with their verify rows in one target forward (the server's batches).
The engine knows no method by name: a drafter's needs are data on it (drafters/base.py).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter

import torch

from specdecode.batch_budget import BatchDraftBudget
from specdecode.batched import forward_groups, padded_inputs
from specdecode.config import SamplingParams, SpecConfig
from specdecode.draft_length import DraftLength
from specdecode.drafters import Drafter, DrafterResources, build_drafter
from specdecode.errors import SpecDecodeError
from specdecode.logprobs import TokenLogprob, token_logprobs
from specdecode.models.kv_cache import CacheBatch
from specdecode.models.loader import LoadedModel, module_bytes
from specdecode.models.quant.quantized_linear import check_quant
from specdecode.prefill import Prefill
from specdecode.prefix_cache import PrefixCache
from specdecode.request_stream import GenerationEvent, RequestStream
from specdecode.spec_types import DraftProposal, Sequence, TargetOutput
from specdecode.speed_guard import PlainStepClock, SpeedGuard
from specdecode.stats import GenerationStats
from specdecode.tree import ForwardInputs, proposal_depth, verify_inputs
from specdecode.verify import verify

Prompt = str | list[dict] | list[int]
# Distinct speculative configurations one Engine keeps drafters for: a server's clients choose options per
# request, and each distinct set would otherwise stay in memory for the Engine's life.
MAX_DRAFTER_CONFIGS = 64


@dataclass
class _StepDraft:
    """What one sequence brings to a step's forward."""

    proposal: DraftProposal
    budget: int  # tokens it was allowed to draft
    start: int  # its root's slot: the last committed token, not in the cache yet
    seconds: float  # spent drafting


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # one per id of token_ids, when sampling.logprobs asks


class Engine:
    def __init__(self, target: LoadedModel, draft: LoadedModel | None = None, spec: SpecConfig | None = None,
                 context_limit: int | None = None, draft_path: str | Path | dict[str, str | Path] | None = None,
                 draft_quant: str = "none", prefix_cache_bytes: int = 0):
        """`draft`: a draft model (method 'draft'); `draft_path`: the weights of a drafter with its own format
        (an EAGLE-3 head or DFlash folder), read by that drafter when a spec first uses it, or a dict from method
        to its folder when several such drafters run; `draft_quant`: what those weights run as (none, int8,
        int4, w4a8; the CLI's --draft-quant with auto resolved); `prefix_cache_bytes`: memory for ended
        requests' KV caches, which later prompts with the same beginning reuse (prefix_cache.py; 0: none)."""
        self.target = target
        self.draft = draft
        self.spec = spec or SpecConfig()
        # The draft indexes its own rope table too, so the shorter of the two contexts bounds a request.
        model_limit = min(m.config.max_position_embeddings for m in (target, draft) if m is not None)
        if context_limit is not None and (type(context_limit) is not int or context_limit < 1):
            raise SpecDecodeError(f"the context limit must be a positive number of tokens (None: the model's "
                                  f"{model_limit}), got {context_limit!r}")
        self.context_limit = model_limit if context_limit is None else min(context_limit, model_limit)
        check_quant(draft_quant, 32)
        paths = {m: str(p) for m, p in draft_path.items()} if isinstance(draft_path, dict) else (
            None if draft_path is None else str(draft_path))
        self.resources = DrafterResources(target, draft, self.context_limit, paths, draft_quant)
        self._members: dict[tuple, Drafter] = {}  # each distinct drafter, created once for every request
        self._drafters: dict[tuple, Drafter] = {}  # spec -> its drafter (a member or a chain of members)
        self.plain_clock = PlainStepClock()  # a plain step's time on this machine, learnt by every request
        self.batch_budget = BatchDraftBudget()  # forward costs by rows and acceptance, for batched steps
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes else None
        self.check_spec(self.spec)

    def drafter(self, spec: SpecConfig) -> Drafter:
        """The drafter for `spec`, created on first use and kept: weights and cross-request caches live once."""
        key = (spec.method, spec.options, spec.combine)
        if key not in self._drafters:
            if len(self._drafters) >= MAX_DRAFTER_CONFIGS:
                raise SpecDecodeError(f"this engine already serves {MAX_DRAFTER_CONFIGS} distinct speculative "
                                      "configurations; use one of those")
            self._drafters[key] = build_drafter(spec, self.resources, self._members)
        return self._drafters[key]

    def check_spec(self, spec: SpecConfig) -> None:
        """Fail before any work if the method is unknown, its options are wrong or it needs a missing model."""
        self.drafter(spec)

    def encode(self, prompt: Prompt, raw: bool = False) -> list[int]:
        """Text goes through the chat template when the model has one (unless raw); ids pass through."""
        tokenizer = self.target.tokenizer
        param = "prompt"
        if isinstance(prompt, str):
            use_chat = tokenizer.has_chat_template and not raw
            ids = tokenizer.encode_chat([{"role": "user", "content": prompt}]) if use_chat else tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
            ids, param = tokenizer.encode_chat(list(prompt)), "messages"
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            if not all(type(t) is int for t in ids):
                raise SpecDecodeError("prompt token ids must be integers", param)
        else:
            raise SpecDecodeError(f"a prompt is text, a list of chat messages or a list of token ids, not "
                                  f"{type(prompt).__name__}", param)
        vocab_size = self.target.config.vocab_size
        # Caught here: in the model an id out of range fails on CPU and is a device assert on CUDA. From text,
        # only a tokenizer that belongs to another model makes one.
        if not all(0 <= t < vocab_size for t in ids):
            raise SpecDecodeError(f"prompt token ids must be in [0, {vocab_size}) (the model's vocabulary)", param)
        if not ids:
            raise SpecDecodeError("the prompt is empty", param)
        if len(ids) >= self.context_limit:
            raise SpecDecodeError(
                f"the prompt has {len(ids)} tokens, which leaves no room in the context of {self.context_limit}",
                param)
        return ids

    def generate(self, prompt: Prompt, sampling: SamplingParams | None = None, spec: SpecConfig | None = None,
                 raw: bool = False) -> Iterator[GenerationEvent]:
        stream = self.open(prompt, sampling, spec, raw)
        try:
            event = stream.first_event()
            yield event
            while event.finish_reason is None:
                event = stream.event(self.step(stream.seq))
                yield event
        finally:
            self.finish(stream.seq)

    def open(self, prompt: Prompt, sampling: SamplingParams | None = None, spec: SpecConfig | None = None,
             raw: bool = False) -> RequestStream:
        """Start a request (prefill) as a stream of events; its caller steps `stream.seq` (alone or in a batch,
        see step_many), hands each step's tokens to `stream.event`, and calls `finish` once it ends."""
        started = perf_counter()
        return self.stream(self.start(self.encode(prompt, raw), sampling or SamplingParams(), spec or self.spec),
                           started)

    def stream(self, seq: Sequence, started: float) -> RequestStream:
        """The events of a started request that arrived at perf_counter() `started`."""
        return RequestStream(seq, self.target.tokenizer, started, self._record_request_end)

    def complete(self, prompt: Prompt, sampling: SamplingParams | None = None, spec: SpecConfig | None = None,
                 raw: bool = False) -> GenerationResult:
        """Run generate() to the end and collect the result."""
        text, ids, logprobs = [], [], []
        for event in self.generate(prompt, sampling, spec, raw):
            text.append(event.text)
            ids.extend(event.token_ids)
            logprobs.extend(event.logprobs or ())
        asked = event.logprobs is not None
        return GenerationResult("".join(text), ids, event.finish_reason, event.stats, logprobs if asked else None)

    def request_cache_bytes(self, prompt_len: int, sampling: SamplingParams, spec: SpecConfig) -> int:
        """What `start` will allocate for a request's target KV cache (a server budgets memory with it)."""
        slots = self._cache_slots(prompt_len, sampling, self.drafter(spec), spec)
        config = self.target.model.config
        per_slot = 2 * config.num_layers * config.num_kv_heads * config.head_dim * self.target.model.dtype.itemsize
        return slots * (per_slot + 8)  # + each slot's int64 position

    def _cache_slots(self, prompt_len: int, sampling: SamplingParams, drafter: Drafter, spec: SpecConfig) -> int:
        """The request's most tokens, plus room for a step's proposed nodes until the rejected ones are dropped."""
        capacity = min(self.context_limit, prompt_len + sampling.max_tokens)
        return capacity + drafter.max_nodes(self._draft_length(drafter, spec).maximum)

    @staticmethod
    def _draft_length(drafter: Drafter, spec: SpecConfig) -> DraftLength:
        block = drafter.caps.block_size  # a block drafter's length is its block, cut by the token budget only
        return DraftLength(block - 1, False) if block else DraftLength(spec.num_draft_tokens, spec.adaptive)

    @torch.inference_mode()
    def start(self, prompt_ids: list[int], sampling: SamplingParams, spec: SpecConfig) -> Sequence:
        """A new request: prefill the target (and the drafter), sample the first token."""
        return self.begin(prompt_ids, sampling, spec).run()

    def begin(self, prompt_ids: list[int], sampling: SamplingParams, spec: SpecConfig,
              chunk: int | None = None, reuse_prefix: bool = True) -> Prefill:
        """A new request whose prompt is read `chunk` tokens per `Prefill.advance` (None: in one forward); its
        caches are allocated here, and the longest prefix the prefix cache holds is copied in unless
        `reuse_prefix` is False (a client's `cache_prompt: false`)."""
        drafter = self.drafter(spec)
        capacity = min(self.context_limit, len(prompt_ids) + sampling.max_tokens)
        draft_length = self._draft_length(drafter, spec)
        generator = torch.Generator(device=self.target.model.device)
        generator.manual_seed(sampling.seed if sampling.seed is not None else random.getrandbits(63))
        cache = self.target.model.new_cache(self._cache_slots(len(prompt_ids), sampling, drafter, spec))
        eos = frozenset() if sampling.ignore_eos else self.target.tokenizer.eos_token_ids
        guard = SpeedGuard(self.plain_clock, spec.guard and drafter.caps.drafts)
        stats = GenerationStats(method=spec.method, prompt_tokens=len(prompt_ids), relaxed=spec.relaxed)
        seq = Sequence(list(prompt_ids), len(prompt_ids), sampling, spec, generator, capacity, cache, drafter,
                       draft_length, stats, eos, guard)
        reused = None
        if self.prefix_cache is not None and reuse_prefix:
            reused = self.prefix_cache.restore(seq)
        stats.cached_prompt_tokens = cache.lengths[0]
        return Prefill(seq, chunk, self.target.model.device,
                       lambda seq, inputs: self._forward(seq, inputs, logits_at=slice(-1, None)), self._started,
                       reused)

    def _started(self, seq: Sequence, prefill: TargetOutput, target_seconds: float) -> None:
        """The prompt is in the target's cache (`prefill`: its hidden states, the last row's logits): sample the
        first token and start the drafter."""
        self.batch_budget.observe_prefill(seq.prompt_len - seq.stats.cached_prompt_tokens, target_seconds)
        first = verify(DraftProposal.empty(), prefill.logits, seq.sampling, seq.generator).next_token
        seq.tokens.append(first)
        self._record_logprobs(seq, prefill.logits, [first])
        drafter_began = perf_counter()
        seq.drafter.start(seq, prefill)
        seq.stats.drafter_prefill_seconds = perf_counter() - drafter_began
        self.batch_budget.observe_start(seq, seq.stats.drafter_prefill_seconds)
        seq.reused_drafter_rows = {}  # taken (or not wanted) by the drafter's start: the entry may go
        seq.stats.prefill_seconds = target_seconds + seq.stats.drafter_prefill_seconds
        if self.prefix_cache is not None:  # now, so that requests arriving while this one decodes reuse it
            if seq.drafter.caps.hidden_layers or seq.drafter.caps.final_hidden:
                seq.read_states.append(_states_of(prefill, seq.drafter))
            self.prefix_cache.store(seq)

    @torch.inference_mode()
    def step(self, seq: Sequence) -> list[int]:
        """One speculative step; -> the tokens it committed (at least one)."""
        return self.step_many([seq])[0]

    @torch.inference_mode()
    def step_many(self, seqs: list[Sequence]) -> list[list[int]]:
        """One speculative step of each sequence, their verify rows in one target forward (batched.py); -> each
        one's committed tokens. A sequence alone is held to its speed guard; in a batch, to the draft length
        the load allows (batch_budget.py). Each sequence's tokens are what stepping it alone would commit given
        the same draft: bitwise on a batch-invariant target (models/batch_invariance.py); others may differ at
        near-ties."""
        began = perf_counter()
        wanted = [self._wanted(seq) for seq in seqs]
        cap = self.batch_budget.draft_cap(seqs, wanted) if len(seqs) > 1 else None
        drafts = self._propose(seqs, wanted, cap)
        proposed = perf_counter()
        outputs = self._verify_forwards(seqs, drafts)
        committed = [self._commit(seq, draft, out) for seq, draft, out in zip(seqs, drafts, outputs)]
        ended = perf_counter()
        for seq, draft, tokens in zip(seqs, drafts, committed):
            if len(seqs) == 1:
                seq.guard.observe(ended - began, len(tokens), draft.proposal.size, draft.seconds)
            self.batch_budget.observe_sequence(seq, draft.budget, len(tokens) - 1, draft.seconds)
            seq.stats.draft_seconds += draft.seconds
            seq.stats.verify_seconds += ended - proposed  # a batch's forward counts for each of its sequences
        self.batch_budget.end_step()
        return committed

    @staticmethod
    def _wanted(seq: Sequence) -> int:
        """Tokens the sequence's draft length asks for this step, within its token budget and context."""
        room = min(seq.capacity - len(seq.tokens), seq.sampling.max_tokens - seq.generated)
        return min(seq.draft_length.current, room - 1)  # a step commits up to budget + 1 tokens

    @staticmethod
    def _propose(seqs: list[Sequence], wanted: list[int], cap: int | None) -> list[_StepDraft]:
        """Each sequence's budget (its guard alone, the load's cap in a batch), then the proposals, each drafter
        asked once for all its sequences (its forwards may batch); a drafter's time is shared among them."""
        budgets, reasons = [], []
        for seq, want in zip(seqs, wanted):
            if cap is None:
                budget, withheld = seq.guard.budget(want)
            else:
                budget, withheld = min(want, cap), ("batch_load" if cap == 0 and want > 0 else None)
            budgets.append(budget)
            reasons.append(withheld or ("no_room" if want <= 0 else "no_proposal"))
        drafts: list[_StepDraft | None] = [None] * len(seqs)
        for drafter in {id(seq.drafter): seq.drafter for seq in seqs}.values():
            members = [b for b, seq in enumerate(seqs) if seq.drafter is drafter]
            began = perf_counter()
            if len(members) == 1:  # alone: the drafter's own propose
                seq, budget = seqs[members[0]], budgets[members[0]]
                proposals = [drafter.propose(seq, budget) if budget > 0 else DraftProposal.empty(drafter.name)]
            else:
                proposals = drafter.propose_many([seqs[b] for b in members], [budgets[b] for b in members])
            seconds = (perf_counter() - began) / len(members)
            for b, proposal in zip(members, proposals):
                if proposal.size == 0 and drafter.caps.drafts:
                    seqs[b].stats.record_undrafted(proposal.withheld or reasons[b])
                start = len(seqs[b].tokens) - 1  # the root: the last committed token, not in the cache yet
                drafts[b] = _StepDraft(proposal, budgets[b], start, seconds)
        return drafts

    def _commit(self, seq: Sequence, draft: _StepDraft, out: TargetOutput) -> list[int]:
        """Verify the sequence's proposal against its rows of the forward, keep the accepted path, commit."""
        proposal = draft.proposal
        result = verify(proposal, out.logits, seq.sampling, seq.generator, seq.spec.relaxation)
        seq.cache.keep(draft.start, result.kept_rows)
        seq.tokens.extend(result.tokens)
        accepted_path = out.rows(result.kept_rows)
        seq.drafter.commit(seq, result, accepted_path)
        if seq.read_states:
            seq.read_states.append(_states_of(accepted_path, seq.drafter))
        self._record_logprobs(seq, accepted_path.logits, result.tokens)
        depth = proposal_depth(proposal)
        seq.draft_length.update(depth, result.num_accepted)
        seq.stats.record_step(proposal.source, proposal.size, depth, result.num_accepted, len(result.tokens))
        return result.tokens

    def _verify_forwards(self, seqs: list[Sequence], drafts: list[_StepDraft]) -> list[TargetOutput]:
        """Each sequence's rows of the target, in as few forwards as their caches allow (usually one)."""
        device = self.target.model.device
        inputs = [verify_inputs(seq.tokens[-1], d.proposal, d.start, device) for seq, d in zip(seqs, drafts)]
        if len(seqs) == 1:
            return [self._forward(seqs[0], inputs[0])]
        rows = [item.tokens.shape[1] for item in inputs]
        outputs: list[TargetOutput | None] = [None] * len(seqs)
        for group in forward_groups([d.start for d in drafts], rows, [s.cache.capacity for s in seqs]):
            members = [seqs[b] for b in group]
            began = perf_counter()
            batch_out = self._forward_batch(members, padded_inputs([inputs[b] for b in group]))
            self.batch_budget.observe_forward(len(group) * max(rows[b] for b in group), perf_counter() - began)
            for b, out in zip(group, batch_out):
                outputs[b] = out.rows(list(range(rows[b])))
        return outputs

    def finish(self, seq: Sequence) -> None:
        """The request ended (or was dropped): the drafter lets go of its state for it, and the prefix cache
        keeps what the target read (prompt and answer: a chat's next turn begins with both)."""
        self._record_request_end(seq)
        if self.prefix_cache is not None and seq.generated:
            self.prefix_cache.store(seq)
        seq.drafter.finish(seq)
        seq.stats.drafter_cache_bytes = seq.drafter.cache_bytes()

    @staticmethod
    def _record_request_end(seq: Sequence) -> None:
        """Stats known once a request stops stepping: its memory and what the speed guard did."""
        seq.stats.kv_cache_bytes = seq.cache.nbytes
        seq.stats.drafter_request_bytes = seq.drafter.request_bytes(seq)
        seq.stats.guard_shrinks, seq.stats.guard_pauses = seq.guard.shrinks, seq.guard.pauses

    def drafter_weights_bytes(self) -> int:
        """Memory of the drafters' own weights (EAGLE-3 heads, each once; the draft model counts as a model)."""
        return sum(module_bytes(module) for module in self.resources.own_weights.values())

    def drafter_cache_bytes(self) -> int:
        """Memory of every drafter's cross-request caches (each drafter once, whatever combinations use it)."""
        return sum(member.cache_bytes() for member in self._members.values())

    def _forward(self, seq: Sequence, inputs: ForwardInputs, logits_at: slice | None = None) -> TargetOutput:
        """One target forward, with the hidden states the sequence's drafter reads; batch dimension removed."""
        caps = seq.drafter.caps
        out = self.target.model(inputs.tokens, inputs.positions, seq.cache, attn_mask=inputs.mask,
                                hidden_layers=caps.hidden_layers, logits_at=logits_at, final_hidden=caps.final_hidden)
        final = None if out.final_hidden is None else out.final_hidden[0]  # [T, H]
        return TargetOutput(out.logits[0], {k: v[0] for k, v in out.hidden.items()}, final)

    def _forward_batch(self, seqs: list[Sequence], inputs: ForwardInputs) -> list[TargetOutput]:
        """One target forward over several sequences' padded rows (each with its own cache); -> each one's output
        over all T rows (padding included), with the hidden states any of their drafters reads."""
        hidden_layers = tuple(sorted({layer for seq in seqs for layer in seq.drafter.caps.hidden_layers}))
        final_hidden = any(seq.drafter.caps.final_hidden for seq in seqs)
        out = self.target.model(inputs.tokens, inputs.positions, CacheBatch([seq.cache for seq in seqs]),
                                attn_mask=inputs.mask, hidden_layers=hidden_layers, final_hidden=final_hidden)
        return [TargetOutput(out.logits[b], {k: v[b] for k, v in out.hidden.items()},
                             None if out.final_hidden is None else out.final_hidden[b]) for b in range(len(seqs))]

    @staticmethod
    def _record_logprobs(seq: Sequence, logits: torch.Tensor, tokens: list[int]) -> None:
        """Only when the request asks: row i of logits [len(tokens), V] is the distribution tokens[i] came from."""
        if seq.sampling.logprobs is not None:
            seq.logprobs.extend(token_logprobs(logits, tokens, seq.sampling.logprobs))


def _states_of(out: TargetOutput, drafter: Drafter) -> TargetOutput:
    """The hidden states `drafter` reads of `out`'s rows, copied (a step's rows are views of a forward whose logits
    are [T, V]: keeping a view would keep those), with no logits."""
    caps = drafter.caps
    hidden = {layer: out.hidden[layer].clone() for layer in caps.hidden_layers}  # [T', H] each
    final = out.final_hidden.clone() if caps.final_hidden else None  # [T', H]
    return TargetOutput(torch.empty(0), hidden, final)

"""The speculative loop: a request is begun, its prompt read (prefill), then each step proposes -> runs one target
forward -> verifies -> keeps the accepted path -> commits, until the request ends; then it is finished.

One way into a request, whatever the front door: `begin` allocates it, `prefill` reads its prompt (whole, or a
chunk per call) and gives the first event, `step` / `step_many` give one event per request per step (several
requests' verify rows share one target forward), `finish` lets go of it. `generate()` is that loop as the one
iterator the Python API, the command line and the bench share; the server's scheduler drives the same calls.
The engine knows no method by name: a drafter's needs are data on it (drafters/base.py).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter

import torch

from specdecode.acceptance.logprobs import TokenLogprob
from specdecode.acceptance.noise import PositionNoise
from specdecode.acceptance.relaxed import Relaxed
from specdecode.acceptance.tree import proposal_depth
from specdecode.config import SamplingParams, SpecConfig
from specdecode.drafters import Drafter, DrafterResources, build_drafter, capabilities
from specdecode.drafters.draft_length import draft_length_for, proposed_nodes, rollback_rows
from specdecode.engine.checked_spec import CheckedSpec, check
from specdecode.engine.forward import states_read, verify_forwards, verify_inputs
from specdecode.engine.load_budget import BatchDraftBudget
from specdecode.engine.prefill import read_chunk
from specdecode.engine.prefix_cache import PrefixCache
from specdecode.engine.provenance import StepTrace, TokenOrigin, origins
from specdecode.engine.request import GenerationEvent, Request
from specdecode.engine.speed_guard import PlainStepClock, SpeedGuard
from specdecode.engine.stats import GenerationStats
from specdecode.engine.warm_up import warm_up
from specdecode.errors import SpecDecodeError
from specdecode.models.kernels.quantized_linear import check_quant
from specdecode.models.loader import LoadedModel, module_bytes
from specdecode.models.tokenizer import IncrementalDetokenizer
from specdecode.spec_types import DraftProposal, TargetOutput

Prompt = str | list[dict] | list[int]
# Distinct speculative configurations one Engine keeps drafters for: a server's clients choose options per
# request, and each distinct set would otherwise stay in memory for the Engine's life. Past this, the least
# recently used one goes (never the engine's default), so no client can use up the room others need.
MAX_DRAFTER_CONFIGS = 64


@dataclass
class _StepDraft:
    """What one request brings to a step's forward."""

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
        int4, w4a8, w3a8; the CLI's --draft-quant with auto resolved); `prefix_cache_bytes`: memory for ended
        requests' KV caches, which later prompts with the same beginning reuse (prefix_cache.py; 0: none)."""
        self.target = target
        self.draft = draft
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
        # spec key -> its drafter (a member or a combination of members), least recently used first
        self._drafters: OrderedDict[tuple, Drafter] = OrderedDict()
        self.plain_clock = PlainStepClock()  # a plain step's time on this machine, learnt by every request
        self.load_budget = BatchDraftBudget()  # forward costs by rows and acceptance, for batched steps
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes else None
        self.spec = self.check_spec(spec or SpecConfig())
        self._default_key = self._key(self.spec)
        self.drafter(self.spec)  # the default's weights load now: a bad folder fails before the first request

    def warm_up(self, spec: SpecConfig | None = None) -> list[str]:
        """A few short requests with each method of `spec` (default: the engine's default), so that the first real
        one runs warm, then forget them (engine/warm_up.py) -> the methods that ran."""
        return warm_up(self, self.spec if spec is None else self.check_spec(spec))

    def forget_learned(self) -> None:
        """Drop what requests taught this engine (timings, per-step choice, drafters' cross-request caches, the
        prefix cache), keeping the models, drafters' own weights, members that keep nothing across requests and
        what the warm-up measured (resources.warm_measures): as it was after load, on a machine timed once."""
        self._drafters.clear()  # combinations and their per-step choice's estimates
        for key in [key for key, member in self._members.items() if capabilities.cache_bytes(member)]:
            del self._members[key]  # a suffix cache, a shared adjacency matrix: made again, empty
        self.plain_clock = PlainStepClock()
        self.load_budget = BatchDraftBudget()
        if self.prefix_cache is not None:
            self.prefix_cache = PrefixCache(self.prefix_cache.capacity_bytes)
        self.drafter(self.spec)

    def check_spec(self, spec: SpecConfig, given: Iterable[str] = ()) -> CheckedSpec:
        """`spec` as this engine runs it: our method names, `auto` replaced by the drafters found for what was
        loaded, checked against the registry and those resources (checked_spec.py; `given`: the drafter options a
        user named, which must belong to its methods); builds nothing (safe from any thread). A SpecDecodeError
        says what is wrong. Pass the result on: what takes a spec takes it without checking it again."""
        if isinstance(spec, CheckedSpec) and spec.checked_by == id(self) and not given:
            return spec
        return check(spec, self.resources, id(self), given)

    def drafter(self, spec: SpecConfig) -> Drafter:
        """The drafter for `spec` (checked as check_spec does, `auto` expanded), created on first use and kept:
        weights and cross-request caches live once. It may load weights: call it where the models are owned."""
        spec = self.check_spec(spec)
        key = self._key(spec)
        if key not in self._drafters:
            self._drafters[key] = build_drafter(spec, self.resources, self._members)
            self._evict_drafters()
        self._drafters.move_to_end(key)
        return self._drafters[key]

    @staticmethod
    def _key(spec: SpecConfig) -> tuple:
        return spec.method, spec.options, spec.combine

    def _evict_drafters(self) -> None:
        """Past MAX_DRAFTER_CONFIGS, drop the least recently used configurations (never the default) and the
        members no kept configuration uses. A running request keeps its own reference to its drafter."""
        while len(self._drafters) > MAX_DRAFTER_CONFIGS:
            del self._drafters[next(key for key in self._drafters if key != self._default_key)]
        used = {id(part) for drafter in self._drafters.values() for part in capabilities.parts(drafter)}
        for key in [key for key, member in self._members.items() if id(member) not in used]:
            del self._members[key]

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
        self.check_prompt(ids, param)
        return ids

    def check_prompt(self, ids: list[int], param: str = "prompt") -> None:
        """Token ids a request can start from: in the vocabulary, not empty, leaving room in the context."""
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

    def generate(self, prompt: Prompt, sampling: SamplingParams | None = None, spec: SpecConfig | None = None,
                 raw: bool = False, provenance: bool = False) -> Iterator[GenerationEvent]:
        """One request's events, from its first token to its last (which carries the stats); with `provenance`,
        each event says where its tokens came from (engine/provenance.py)."""
        request = self.begin(self.encode(prompt, raw), sampling, spec, provenance=provenance)
        try:
            event = self.prefill(request)
            yield event
            while event.finish_reason is None:
                event = self.step(request)
                yield event
        finally:
            self.finish(request)

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
        """What `begin` will allocate for a request's target KV cache (a server budgets memory with it). It builds
        the spec's drafter if none is built yet: call it where the models are owned (the server's worker)."""
        drafter = self.drafter(spec)
        return self._cache_bytes(self._cache_slots(prompt_len, sampling, drafter, spec),
                                 rollback_rows(drafter, spec))

    def least_cache_bytes(self, prompt_len: int, sampling: SamplingParams) -> int:
        """A lower bound of request_cache_bytes that builds nothing (safe from any thread): the request's tokens
        without room for a step's proposal."""
        return self._cache_bytes(min(self.context_limit, prompt_len + sampling.max_tokens))

    def _cache_bytes(self, slots: int, rollback: int = 1) -> int:
        return self.target.model.cache_bytes(slots, rollback)

    def _cache_slots(self, prompt_len: int, sampling: SamplingParams, drafter: Drafter, spec: SpecConfig) -> int:
        """The request's most tokens, plus room for a step's proposed nodes until the rejected ones are dropped."""
        return min(self.context_limit, prompt_len + sampling.max_tokens) + proposed_nodes(drafter, spec)

    def begin(self, prompt_ids: list[int], sampling: SamplingParams | None = None, spec: SpecConfig | None = None,
              chunk: int | None = None, reuse_prefix: bool = True, provenance: bool = False) -> Request:
        """A new request, its prompt not read yet (`prefill` reads it, `chunk` tokens per call; None: whole). Its
        caches are allocated here, and the longest prefix the prefix cache holds is copied in unless
        `reuse_prefix` is False (a client's `cache_prompt: false`). `provenance`: its events say where each token
        came from (engine/provenance.py)."""
        arrived = perf_counter()
        sampling = sampling or SamplingParams()
        spec = self.spec if spec is None else self.check_spec(spec)
        self.check_prompt(prompt_ids)
        drafter = self.drafter(spec)
        draft_length = draft_length_for(drafter, spec)
        seed = sampling.seed if sampling.seed is not None else random.getrandbits(63)
        generator = torch.Generator(device=self.target.model.device)
        generator.manual_seed(seed)
        rule = spec.verification_for(sampling)
        noise = None if rule != "coupled" or sampling.greedy else PositionNoise(
            seed, self.target.config.vocab_size, self.target.model.device)
        # A hybrid trunk's recurrent states roll back over one verify forward's rows (root and proposed nodes).
        cache = self.target.model.new_cache(self._cache_slots(len(prompt_ids), sampling, drafter, spec),
                                            rollback_rows=rollback_rows(drafter, spec))
        stats = GenerationStats(method=spec.method, prompt_tokens=len(prompt_ids), relaxed=spec.relaxed,
                                verification=rule, seed=seed)
        request = Request(
            list(prompt_ids), len(prompt_ids), sampling, spec, generator,
            min(self.context_limit, len(prompt_ids) + sampling.max_tokens), cache, drafter, draft_length.maximum,
            eos=frozenset() if sampling.ignore_eos else self.target.tokenizer.eos_token_ids,
            guard=SpeedGuard(self.plain_clock, spec.guard and drafter.caps.drafts), draft_length=draft_length,
            stats=stats, detokenizer=IncrementalDetokenizer(self.target.tokenizer, sampling.stop), arrived=arrived,
            chunk=chunk or len(prompt_ids), relaxation=None if spec.relaxed is None else Relaxed.parse(spec.relaxed),
            verification=rule, noise=noise, provenance=provenance)
        stats.drafter_notes = request.drafter_notes  # one dict: what the drafter notes is in the stats
        stats.choices = request.choices  # and what per-step choice records
        if self.prefix_cache is not None and reuse_prefix:
            reused = self.prefix_cache.restore(request)
            if reused is not None:
                request.prompt_parts.append(reused)
        stats.cached_prompt_tokens = cache.lengths[0]
        return request

    @torch.inference_mode()
    def prefill(self, request: Request, tokens: int | None = None) -> GenerationEvent | None:
        """Read the next `tokens` of the request's prompt (None: its `chunk`); once it is all read, sample the first
        token, start the drafter and -> the first event (None while chunks remain)."""
        began = perf_counter()
        prompt = read_chunk(self.target.model, request, request.chunk if tokens is None else tokens)
        request.stats.prefill_seconds += perf_counter() - began
        if prompt is None:
            return None
        target_seconds = request.stats.prefill_seconds
        self.load_budget.observe_prefill(request.prompt_len - request.stats.cached_prompt_tokens, target_seconds)
        request.target_prefill_seconds_per_token = self.load_budget.prefill_seconds_per_token
        first = request.verdict(DraftProposal.empty(), prompt.logits).next_token
        request.tokens.append(first)
        if request.provenance:
            request.pending_origins = [TokenOrigin("target")]
        request.record_logprobs(prompt.logits, [first])
        drafter_began = perf_counter()
        request.drafter.start(request, prompt)
        request.stats.drafter_prefill_seconds = perf_counter() - drafter_began
        self.load_budget.observe_start(request, request.stats.drafter_prefill_seconds)
        request.reused_drafter_rows = {}  # taken (or not wanted) by the drafter's start: the entry may go
        request.stats.prefill_seconds = target_seconds + request.stats.drafter_prefill_seconds
        if self.prefix_cache is not None:  # now, so that requests arriving while this one decodes reuse it
            if request.drafter.caps.hidden_layers or request.drafter.caps.final_hidden:
                request.read_states.append(states_read(prompt, request.drafter))
            self.prefix_cache.store(request)
        return request.settle([first])

    def step(self, request: Request) -> GenerationEvent:
        """One speculative step of a started request; -> the event for what it committed (at least one token)."""
        return self.step_many([request])[0]

    @torch.inference_mode()
    def step_many(self, requests: list[Request]) -> list[GenerationEvent]:
        """One speculative step of each request, their verify rows in one target forward (engine/forward.py); ->
        each one's event. A request alone is held to its speed guard; in a batch, to the draft length the load
        allows (load_budget.py). Each request's tokens are what stepping it alone would commit given the same
        draft: bitwise on a batch-invariant target (models/batch_invariance.py); others may differ at near-ties."""
        began = perf_counter()
        wanted = [self._wanted(request) for request in requests]
        cap = self.load_budget.draft_cap(requests, wanted) if len(requests) > 1 else None
        drafts = self._propose(requests, wanted, cap)
        proposed = perf_counter()
        device = self.target.model.device
        inputs = [verify_inputs(r.tokens[-1], d.proposal, d.start, device) for r, d in zip(requests, drafts)]
        outputs = verify_forwards(self.target.model, requests, inputs, self.load_budget)
        committed = [self._commit(request, draft, row_inputs.tokens[0], out)
                     for request, draft, row_inputs, out in zip(requests, drafts, inputs, outputs)]
        ended = perf_counter()
        for request, draft, tokens in zip(requests, drafts, committed):
            if request.provenance:
                proposal = draft.proposal
                request.last_step = StepTrace(request.stats.target_forwards, proposal.source if proposal.size else "",
                                              proposal.tokens.tolist(),
                                              None if proposal.is_chain else proposal.parent_list(),
                                              len(tokens) - 1 if proposal.size else 0, ended - began)
            if len(requests) == 1:
                request.guard.observe(ended - began, len(tokens), draft.proposal.size, draft.seconds,
                                      draft.proposal.caught_up)
            self.load_budget.observe_sequence(request, draft.budget, len(tokens) - 1, draft.seconds)
            request.stats.draft_seconds += draft.seconds
            request.stats.verify_seconds += ended - proposed  # a batch's forward counts for each of its requests
        self.load_budget.end_step()
        return [request.settle(tokens) for request, tokens in zip(requests, committed)]

    @staticmethod
    def _wanted(request: Request) -> int:
        """Tokens the request's draft length asks for this step, within its token budget and context."""
        room = min(request.capacity - len(request.tokens), request.sampling.max_tokens - request.generated)
        return min(request.draft_length.current, room - 1)  # a step commits up to budget + 1 tokens

    @staticmethod
    def _propose(requests: list[Request], wanted: list[int], cap: int | None) -> list[_StepDraft]:
        """Each request's budget (its guard alone, the load's cap in a batch), then the proposals, each drafter
        asked once for all its requests (its forwards may batch); a drafter's time is shared among them."""
        budgets, reasons = [], []
        for request, want in zip(requests, wanted):
            if cap is None:
                budget, withheld = request.guard.budget(want)
            else:
                budget, withheld = min(want, cap), ("batch_load" if cap == 0 and want > 0 else None)
            budgets.append(budget)
            reasons.append(withheld or ("no_room" if want <= 0 else "no_proposal"))
        drafts: list[_StepDraft | None] = [None] * len(requests)
        for drafter in {id(request.drafter): request.drafter for request in requests}.values():
            members = [b for b, request in enumerate(requests) if request.drafter is drafter]
            began = perf_counter()
            if len(members) == 1:  # alone: the drafter's own propose
                request, budget = requests[members[0]], budgets[members[0]]
                proposals = [drafter.propose(request, budget) if budget > 0 else DraftProposal.empty(drafter.name)]
            else:
                proposals = capabilities.propose_many(drafter, [requests[b] for b in members], [budgets[b] for b in members])
            seconds = (perf_counter() - began) / len(members)
            for b, proposal in zip(members, proposals):
                if proposal.size == 0 and drafter.caps.drafts:
                    requests[b].stats.record_undrafted(proposal.withheld or reasons[b])
                start = len(requests[b].tokens) - 1  # the root: the last committed token, not in the cache yet
                drafts[b] = _StepDraft(proposal, budgets[b], start, seconds)
        return drafts

    def _commit(self, request: Request, draft: _StepDraft, fed: torch.Tensor, out: TargetOutput) -> list[int]:
        """Verify the request's proposal against its rows of the forward (`fed` [T]: the tokens of those rows),
        keep the accepted path, commit."""
        proposal = draft.proposal
        capabilities.observe(request.drafter, request, fed, out)
        result = request.verdict(proposal, out.logits)
        request.cache.keep(draft.start, result.kept_rows)
        request.tokens.extend(result.tokens)
        accepted_path = out.rows(result.kept_rows)
        request.drafter.commit(request, result, accepted_path)
        if request.read_states:
            request.read_states.append(states_read(accepted_path, request.drafter))
        request.record_logprobs(accepted_path.logits, result.tokens)
        if request.provenance:
            request.pending_origins = origins(proposal, result, request.stats.target_forwards + 1)
        depth = proposal_depth(proposal)
        request.draft_length.update(depth, result.num_accepted)
        request.stats.record_step(proposal.source, proposal.size, depth, result.num_accepted, len(result.tokens))
        return result.tokens

    def finish(self, request: Request) -> None:
        """The request ended (or was dropped): the drafter lets go of its state for it, and the prefix cache
        keeps what the target read (prompt and answer: a chat's next turn begins with both)."""
        if request.finish_reason is None:  # dropped before its end: its stats were not closed yet
            request.close_stats()
        if self.prefix_cache is not None and request.started:
            self.prefix_cache.store(request)
        request.drafter.finish(request)
        request.stats.drafter_cache_bytes = capabilities.cache_bytes(request.drafter)

    def drafter_weights_bytes(self) -> int:
        """Memory of the drafters' own weights (EAGLE-3 heads, each once; the draft model counts as a model)."""
        return sum(module_bytes(module) for module in self.resources.own_weights.values())

    def drafter_cache_bytes(self) -> int:
        """Memory of every drafter's cross-request caches (each drafter once, whatever combinations use it)."""
        return sum(capabilities.cache_bytes(member) for member in self._members.values())

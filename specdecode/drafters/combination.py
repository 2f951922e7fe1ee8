"""Combinations such as 'ngram,draft'. combine="first" is llama.cpp's rule: the first member with a proposal
wins the step. combine="best" asks the members' estimates which one promises the most tokens per second
(step_choice.py).

Every member sees every request's start, commit and finish, so a model drafter's cache follows the tokens that
another member's draft got accepted; `result.source` tells each member whose proposal was verified.
"""

from __future__ import annotations

from time import perf_counter
from typing import TYPE_CHECKING

from specdecode.acceptance.tree import proposal_depth
from specdecode.config import SpecConfig
from specdecode.drafters import capabilities
from specdecode.drafters.base import Drafter, DrafterCaps, DrafterResources
from specdecode.drafters.capabilities import Batching, Composite, MemorySizing, ReadsVerifyRows
from specdecode.drafters.registry import DRAFTERS, create_member, member_key, validate_method
from specdecode.drafters.step_choice import StepChooser
from specdecode.spec_types import DraftProposal, Sequence, TargetOutput, VerifyResult

if TYPE_CHECKING:
    import torch

    from specdecode.models.decoder.kv_cache import KVCache


DEFERRED = "combination.deferred"  # seq.drafter_state: the members whose start waits for their first turn


class CombinationDrafter(Drafter, Batching, Composite, MemorySizing, ReadsVerifyRows):
    """Not registered: build_drafter makes one for a spec that names several methods."""

    name = "combination"
    clock = staticmethod(perf_counter)  # tests script it

    def __init__(self, members: list[Drafter], combine: str = "first"):
        self.members = members
        self.chooser = StepChooser([m.name for m in members]) if combine == "best" else None
        caps = [m.caps for m in members]
        self.caps = DrafterCaps(hidden_layers=tuple(sorted({i for c in caps for i in c.hidden_layers})),
                                final_hidden=any(c.final_hidden for c in caps),
                                emits_probs=any(c.emits_probs for c in caps),
                                emits_trees=any(c.emits_trees for c in caps),
                                needs_draft_model=any(c.needs_draft_model for c in caps),
                                draft_files=any(c.draft_files for c in caps))

    @classmethod
    def create(cls, resources: DrafterResources, options) -> Drafter:
        raise TypeError("a combination is built from its members by build_drafter, not created from options")

    def start(self, seq: Sequence, prefill: TargetOutput) -> None:
        """Every member starts, except that per-step choice defers those that can (a draft model's prompt
        forward) until first chosen: a request the lookups serve alone never pays for them."""
        deferred = set()
        for member in self.members:
            if self.chooser is not None and capabilities.defers_start(member):
                member.defer_start(seq)
                deferred.add(member.name)
            else:
                member.start(seq, prefill)
        if deferred:
            seq.drafter_state[DEFERRED] = deferred

    def propose(self, seq: Sequence, budget: int) -> DraftProposal:
        if self.chooser is None:
            for member in self.members:
                proposal = member.propose(seq, budget)
                if proposal.size:
                    return proposal
            return DraftProposal.empty(self.members[-1].name)
        return self._best_many([seq], [budget])[0]

    def propose_many(self, seqs: list[Sequence], budgets: list[int]) -> list[DraftProposal]:
        """First wins, member by member over the whole batch, so that a member whose forwards batch (the draft
        model) drafts for every request the earlier members left without a proposal at once. Best: each request
        chooses its member as alone, and the requests that chose one model member draft together."""
        if self.chooser is not None:
            return self.proposals_for_asked(seqs, budgets, self._best_many)
        proposals = [DraftProposal.empty(self.members[-1].name) for _ in seqs]
        waiting = [i for i, budget in enumerate(budgets) if budget > 0]
        for member in self.members:
            if not waiting:
                break
            offered = capabilities.propose_many(member, [seqs[i] for i in waiting], [budgets[i] for i in waiting])
            for i, proposal in zip(waiting, offered):
                if proposal.size:
                    proposals[i] = proposal
            waiting = [i for i, proposal in zip(waiting, offered) if not proposal.size]
        return proposals

    def _best_many(self, seqs: list[Sequence], budgets: list[int]) -> list[DraftProposal]:
        """Each request's best member (`_ranked`); the requests whose choice is the same sampling member are asked
        together, and one whose choice proposes nothing goes on down its own ranking."""
        proposals: list[DraftProposal | None] = [None] * len(seqs)
        rankings: dict[int, list[tuple[float, Drafter, DraftProposal | None]]] = {}
        for i, (seq, budget) in enumerate(zip(seqs, budgets)):
            proposals[i], ranking = self._ranked(seq, budget)
            if proposals[i] is None:
                rankings[i] = ranking
        plain = self.chooser.plain_promise()
        while rankings:
            asks: dict[str, list[int]] = {}  # member name -> the requests whose best untried choice it is
            for i, ranking in list(rankings.items()):
                if ranking and ranking[0][0] >= plain and ranking[0][2] is None:
                    asks.setdefault(ranking[0][1].name, []).append(i)
                    continue
                if not ranking:
                    proposals[i] = DraftProposal.empty(self.members[-1].name)
                elif ranking[0][0] < plain:
                    proposals[i] = DraftProposal.empty(self.members[-1].name, withheld="chooser_plain")
                else:
                    proposals[i] = ranking[0][2]  # a lookup's proposal, made while ranking
                del rankings[i]
            for group in asks.values():
                member = rankings[group[0]][0][1]
                for i, proposal in zip(group, self._timed_propose_many(member, [seqs[i] for i in group],
                                                                        [budgets[i] for i in group])):
                    if proposal.size:
                        proposals[i] = proposal
                        del rankings[i]
                    else:
                        rankings[i].pop(0)
        stamp = self.clock()  # the verify forward starts after every proposal of the step
        for seq, proposal in zip(seqs, proposals):
            seq.drafter_state[self.name] = (stamp, proposal_depth(proposal), proposal.size)
        return proposals

    def _ranked(self, seq: Sequence, budget: int
                ) -> tuple[DraftProposal | None, list[tuple[float, Drafter, DraftProposal | None]]]:
        """Deterministic members propose now (judged on their proposal); sampling members are judged on their
        estimates and asked only if chosen, so their random drafts never influence whether they are used.
        -> (a lookup's proposal to use outright, or None; the candidates by promise in tokens/s, best first,
        each with its proposal or None = not asked yet)."""
        candidates = []
        for member in self.members:
            if member.caps.emits_probs:
                seconds = self.chooser.drafting_seconds(member.name, budget) + self._start_share(member, seq, budget)
                candidates.append((self.chooser.promise(member.name, budget, budget, seconds), member, None))
                continue
            proposal = self._timed_propose_many(member, [seq], [budget])[0]
            if proposal.size:
                if self.chooser.needs_evidence(member.name):
                    return proposal, []  # free to make: learn what it is worth (step_choice.py)
                promise = self.chooser.promise(member.name, proposal_depth(proposal), proposal.size, 0.0)
                candidates.append((promise, member, proposal))
        return None, sorted(candidates, key=lambda c: -c[0])

    def _start_share(self, member: Drafter, seq: Sequence, budget: int) -> float:
        """The part of a deferred member's first catch-up charged to a step drafting `budget` tokens: the
        catch-up serves every later step of the request, so a step pays (budget + 1) / tokens left of it."""
        if member.name not in seq.drafter_state.get(DEFERRED, ()):
            return 0.0
        left = max(1, seq.sampling.max_tokens - seq.generated)
        share = min(1.0, (budget + 1) / left)
        return share * self.chooser.start_seconds(member.name, capabilities.pending_tokens(member, seq))

    def _timed_propose_many(self, member: Drafter, seqs: list[Sequence], budgets: list[int]) -> list[DraftProposal]:
        """member's proposals, timed into the chooser's estimates: a request where the member starts late (its
        first catch-up, timed apart) alone, the others in one propose_many."""
        proposals: list[DraftProposal | None] = [None] * len(seqs)
        going = []
        for i, seq in enumerate(seqs):
            deferred = seq.drafter_state.get(DEFERRED, set())
            if member.name not in deferred:
                going.append(i)
                continue
            context = capabilities.pending_tokens(member, seq)
            began = self.clock()
            proposals[i] = member.propose(seq, budgets[i])
            deferred.remove(member.name)
            self.chooser.record_start(member.name, self.clock() - began, context, proposals[i].size)
        if going:
            began = self.clock()
            offered = capabilities.propose_many(member, [seqs[i] for i in going], [budgets[i] for i in going])
            self.chooser.record_drafting(member.name, self.clock() - began, sum(p.size for p in offered))
            for i, proposal in zip(going, offered):
                proposals[i] = proposal
        return proposals

    def observe(self, seq: Sequence, fed: torch.Tensor, target: TargetOutput) -> None:
        for member in self.members:
            capabilities.observe(member, seq, fed, target)

    def commit(self, seq: Sequence, result: VerifyResult, target: TargetOutput) -> None:
        if self.chooser is not None:
            proposed = seq.drafter_state.pop(self.name, None)  # None: the engine had no room to ask for drafts
            if proposed is not None:
                proposed_at, depth, nodes = proposed
                self.chooser.record_verdict(result.source, depth, result.num_accepted, nodes,
                                            self.clock() - proposed_at)
        for member in self.members:
            member.commit(seq, result, target)

    def finish(self, seq: Sequence) -> None:
        seq.drafter_state.pop(self.name, None)
        seq.drafter_state.pop(DEFERRED, None)
        for member in self.members:
            member.finish(seq)

    def parts(self) -> list[Drafter]:
        return list(self.members)

    def max_nodes(self, budget: int) -> int:
        return max(capabilities.max_nodes(member, budget) for member in self.members)

    def token_caches(self, seq: Sequence) -> dict[str, KVCache]:
        return {name: cache for member in self.members
                for name, cache in capabilities.token_caches(member, seq).items()}

    def cache_bytes(self) -> int:
        return sum(capabilities.cache_bytes(member) for member in self.members)

    def weights_bytes(self) -> int:
        return sum(capabilities.weights_bytes(member) for member in self.members)

    def request_bytes(self, seq: Sequence) -> int:
        return sum(capabilities.request_bytes(member, seq) for member in self.members)


def build_drafter(spec: SpecConfig, resources: DrafterResources, members: dict[tuple, Drafter]) -> Drafter:
    """The drafter for `spec`, its members taken from (or added to) `members`, so that each distinct drafter
    is created once per Engine whatever combinations it serves in."""
    chosen = []
    for name in validate_method(spec):
        cls = DRAFTERS[name]
        key = member_key(cls, spec)
        if key not in members:
            members[key] = create_member(cls, spec, resources)
        chosen.append(members[key])
    return chosen[0] if len(chosen) == 1 else CombinationDrafter(chosen, spec.combine)

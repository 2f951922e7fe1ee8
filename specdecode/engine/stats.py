"""Speculative-decoding statistics for one request, kept in one place and derived the same way everywhere."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdecode.spec_types import ChoiceRecord


@dataclass
class GenerationStats:
    method: str = "none"
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of them, taken from the prefix cache instead of read (prefix_cache.py)
    new_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    target_forwards: int = 0  # verify forwards after prefill; each commits >= 1 token
    step_tokens: int = 0  # tokens committed by those forwards, bonus included
    drafting_steps: int = 0  # forwards that verified at least one drafted token
    rejections: int = 0  # forwards whose draft was cut short by a rejected token
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_by: dict[str, int] = field(default_factory=dict)  # method -> drafted tokens (for combinations)
    accepted_by: dict[str, int] = field(default_factory=dict)
    prefill_seconds: float = 0.0  # the whole prefill phase: the target's forward and the drafter's start
    drafter_prefill_seconds: float = 0.0  # its share spent in the drafter's start (a draft model's prefill)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    drafter_cache_bytes: int = 0  # the drafter's cross-request caches once this request finished
    kv_cache_bytes: int = 0  # the target's KV cache for this request (allocated for prompt + max_tokens)
    drafter_request_bytes: int = 0  # the drafter's state for this request (a draft model's KV cache)
    # Forwards that verified no draft, by why: "no_proposal" (the drafter found nothing), "no_room" (the token
    # budget or context allowed none), "guard_paused" / "guard_timing_plain" (speed_guard.py), "chooser_plain"
    # (per-step choice found no member worth a draft, drafters/step_choice.py), "batch_load" (load_budget.py).
    steps_without_draft: dict[str, int] = field(default_factory=dict)
    guard_shrinks: int = 0  # times the speed guard halved the draft length
    guard_pauses: int = 0  # times it paused drafting
    relaxed: str | None = None  # the opt-in lossy acceptance rule ("RULE:VALUE"), None when lossless
    verification: str = "block"  # the rule sampled drafts were verified by (config.VERIFICATION_RULES)
    seed: int | None = None  # the seed it sampled with, given or picked: under coupled it gives the same answer again
    # What a drafter says of how it drafted, counted: "mtp_module_reused" (draft tokens made by an MTP model's
    # last module again, when it ships fewer modules than the draft is long).
    drafter_notes: dict[str, int] = field(default_factory=dict)
    # Per-step choice (combine="best"): member chosen, or "plain" -> its steps, promised against realised.
    choices: dict[str, ChoiceRecord] = field(default_factory=dict)

    @property
    def lossless(self) -> bool:
        return self.relaxed is None

    def record_undrafted(self, reason: str) -> None:
        self.steps_without_draft[reason] = self.steps_without_draft.get(reason, 0) + 1

    def record_step(self, source: str, nodes: int, depth: int, accepted: int, committed: int) -> None:
        """One verify forward: `nodes` drafted tokens checked (a tree's every node), its longest path `depth`
        tokens deep (a chain's: all of them), `accepted` of them kept, `committed` tokens added (bonus too)."""
        self.target_forwards += 1
        self.step_tokens += committed
        self.drafted_tokens += nodes
        self.accepted_tokens += accepted
        if nodes:
            self.drafting_steps += 1
            self.rejections += accepted < depth
            self.drafted_by[source] = self.drafted_by.get(source, 0) + nodes
            self.accepted_by[source] = self.accepted_by.get(source, 0) + accepted
        self.cover_positions(depth)
        for position in range(depth):
            self.drafted_per_position[position] += 1
            self.accepted_per_position[position] += position < accepted

    def cover_positions(self, count: int) -> None:
        """Grow the per-position counters to at least `count` draft positions."""
        missing = count - len(self.drafted_per_position)
        if missing > 0:
            self.drafted_per_position += [0] * missing
            self.accepted_per_position += [0] * missing

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def token_acceptance(self) -> float:
        """Leviathan et al.'s alpha: the chance a drafted token the target examines is accepted.

        Each step examines its accepted tokens plus, if any, the one rejected token; later drafts are never
        examined. (accepted / drafted, the acceptance rate, counts those unexamined drafts as failures too.)
        """
        examined = self.accepted_tokens + self.rejections
        return self.accepted_tokens / examined if examined else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per target forward, bonus included: 1.00 for plain decoding."""
        return self.step_tokens / self.target_forwards if self.target_forwards else 1.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def tokens_per_second(self) -> float:
        """New tokens over the whole request's wall time, prefill included (Spec-Bench's definition)."""
        return self.new_tokens / self.total_seconds if self.total_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        decode = self.total_seconds - self.prefill_seconds
        return (self.new_tokens - 1) / decode if decode > 0 and self.new_tokens > 1 else 0.0

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "acceptance": self.relaxed or "exact",
            "lossless": self.lossless,
            "verification": self.verification,
            "seed": self.seed,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "token_acceptance": round(self.token_acceptance, 4),
            "drafting_steps": self.drafting_steps,
            "rejections": self.rejections,
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "accepted_per_position": list(self.accepted_per_position),
            "drafted_per_position": list(self.drafted_per_position),
            "acceptance_per_position": [round(x, 4) for x in self.acceptance_per_position],
            "drafted_by": dict(self.drafted_by),
            "accepted_by": dict(self.accepted_by),
            "drafter_notes": dict(self.drafter_notes),
            "target_forwards": self.target_forwards,
            "tokens_per_second": round(self.tokens_per_second, 3),
            "decode_tokens_per_second": round(self.decode_tokens_per_second, 3),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "drafter_prefill_seconds": round(self.drafter_prefill_seconds, 4),
            "draft_seconds": round(self.draft_seconds, 4),
            "verify_seconds": round(self.verify_seconds, 4),
            "total_seconds": round(self.total_seconds, 4),
            "drafter_cache_bytes": self.drafter_cache_bytes,
            "kv_cache_bytes": self.kv_cache_bytes,
            "drafter_request_bytes": self.drafter_request_bytes,
            "steps_without_draft": dict(self.steps_without_draft),
            "guard_shrinks": self.guard_shrinks,
            "guard_pauses": self.guard_pauses,
            "choices": {member: record.to_dict() for member, record in self.choices.items()},
        }


def combine(parts: list[GenerationStats], method: str) -> GenerationStats:
    """Sum several requests' stats (the turns of a question, the questions of a run) into one."""
    relaxed = {part.relaxed for part in parts} - {None}
    total = GenerationStats(method=method, relaxed=",".join(sorted(relaxed)) or None,
                            verification=",".join(sorted({part.verification for part in parts})) or "block")
    for part in parts:
        for name in ("prompt_tokens", "new_tokens", "drafted_tokens", "accepted_tokens", "target_forwards",
                     "step_tokens", "drafting_steps", "rejections", "prefill_seconds", "drafter_prefill_seconds",
                     "draft_seconds", "verify_seconds", "total_seconds", "guard_shrinks", "guard_pauses"):
            setattr(total, name, getattr(total, name) + getattr(part, name))
        total.cover_positions(len(part.drafted_per_position))
        for position, (drafted, accepted) in enumerate(zip(part.drafted_per_position, part.accepted_per_position)):
            total.drafted_per_position[position] += drafted
            total.accepted_per_position[position] += accepted
        for source, count in part.drafted_by.items():
            total.drafted_by[source] = total.drafted_by.get(source, 0) + count
            total.accepted_by[source] = total.accepted_by.get(source, 0) + part.accepted_by.get(source, 0)
        for reason, count in part.steps_without_draft.items():
            total.steps_without_draft[reason] = total.steps_without_draft.get(reason, 0) + count
        for member, record in part.choices.items():
            total.choices.setdefault(member, ChoiceRecord()).merge(record)
    # One cache, not a sum; requests ran one after another, so the largest one's memory is the peak.
    for name in ("drafter_cache_bytes", "kv_cache_bytes", "drafter_request_bytes"):
        setattr(total, name, max((getattr(part, name) for part in parts), default=0))
    return total

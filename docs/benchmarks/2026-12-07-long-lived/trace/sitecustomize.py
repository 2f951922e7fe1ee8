"""A step-by-step trace of per-step choice, for diagnosis: which candidates each step ranked (member, depth,
promised tokens/s, a lookup's proposal size), the chooser's acceptance estimates and costs, each sampling member's
proposal (tokens it had to catch up on, milliseconds) and the speed guard's verdicts (window tokens/s against plain,
its cap and pause).

Python imports `sitecustomize` at start-up, so with this folder on PYTHONPATH every process of a bench run (its
fresh-process children too) appends JSON lines to $SPECTRACE.<pid>:

    SPECTRACE=/tmp/trace/t PYTHONPATH=docs/benchmarks/2026-12-07-long-lived/trace specdecode bench ...

It wraps private methods (CombinationDrafter._ranked, _timed_propose_many, SpeedGuard._verdict): a diagnostic
for the commit it was written on (6c09399), not an interface. Output is unchanged; each step writes one line.
"""

import json
import os
from time import perf_counter

if os.environ.get("SPECTRACE"):
    from specdecode.drafters import capabilities, combination
    from specdecode.engine import speed_guard

    trace = open(os.environ["SPECTRACE"] + f".{os.getpid()}", "a")  # noqa: SIM115 (open for the process's life)
    ranked, timed_propose_many, verdict = (combination.CombinationDrafter._ranked,
                                           combination.CombinationDrafter._timed_propose_many,
                                           speed_guard.SpeedGuard._verdict)

    def traced_ranked(self, seq, budget):
        outright, ranking = ranked(self, seq, budget)
        members = self.chooser.members
        trace.write(json.dumps({
            "gen": seq.generated, "budget": budget, "plain": round(self.chooser.plain_promise(), 1),
            "outright": outright.member.name if outright else None,
            "rank": [(c.member.name, c.depth, round(c.promise, 1), c.proposal.size if c.proposal else None)
                     for c in ranking],
            "acc": {name: [round(e.acceptance(i, self.chooser.prior(name)), 2) for i in range(4)]
                    for name, e in members.items()},
            "cost_ms": {name: (round(e.seconds_per_token * 1e3, 2), round(e.seconds_per_start_token * 1e3, 3))
                        for name, e in members.items()},
            "deferred": sorted(seq.drafter_state.get(combination.DEFERRED, ()))}) + "\n")
        return outright, ranking

    def traced_timed_propose_many(self, member, seqs, budgets):
        if not member.caps.emits_probs:
            return timed_propose_many(self, member, seqs, budgets)
        pending = [capabilities.pending_tokens(member, seq) for seq in seqs]
        began = perf_counter()
        proposals = timed_propose_many(self, member, seqs, budgets)
        trace.write(json.dumps({"TIMED": member.name, "pending": pending, "budgets": budgets,
                                "sizes": [p.size for p in proposals], "ms": round((perf_counter() - began) * 1e3, 2),
                                "gen": [seq.generated for seq in seqs]}) + "\n")
        return proposals

    def traced_verdict(self):
        window, plain = self.window_tokens / self.window_seconds, 1 / self.clock.seconds
        verdict(self)
        trace.write(json.dumps({"verdict": round(window, 1), "plain_rate": round(plain, 1), "cap": self.cap,
                                "pause": self.paused_steps_left}) + "\n")
        trace.flush()

    combination.CombinationDrafter._ranked = traced_ranked
    combination.CombinationDrafter._timed_propose_many = traced_timed_propose_many
    speed_guard.SpeedGuard._verdict = traced_verdict

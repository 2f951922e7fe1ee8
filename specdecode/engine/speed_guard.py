"""Never slower than plain decoding: per request, shrink the draft and then pause drafting while speculation
measures slower than the target alone, and probe again later.

Speculation pays when a step's committed tokens outweigh what drafting and the wider verify forward cost; on a CPU
with a cheap quantized target a draft model can lose (`draft` at 0.89x of plain on a w4a8 target: docs/benchmarks,
2026-12-01 guard). Acceptance alone cannot tell: the break-even point depends on this machine's costs. So the guard
compares measured rates. A window of steps run with drafts gives speculative tokens per second; steps that verified
no draft (whatever the reason), less any time a drafter spent proposing nothing, give the plain step's time, kept
per Engine so that each request starts with it. Below plain, the guard first halves the draft length, then pauses
drafting for a number of steps that doubles each time a probe fails again. A probe drafts one token; each window
that beats plain lets the draft grow by one token again.

Output never depends on the guard with greedy decoding, nor with sampling under the coupled rule (each position's
randomness is fixed by the seed: acceptance/noise.py). Under the block and token-wise rules, which steps drafted
decides which random draws make each token (the distribution is unchanged); timing decides the guard, so only
with the guard off (`--no-guard`) does nothing a seeded request draws depend on timing.
"""

from __future__ import annotations

WINDOW = 8  # drafting steps measured per verdict: about half a second on the default pair (w4a8)
FIRST_PAUSE = 16  # steps without drafts after the first failed probe
MAX_PAUSE = 256  # the pause doubles with every failed probe up to this
PLAIN_SMOOTHING = 0.2  # weight of the newest plain step in the running estimate of its time


class PlainStepClock:
    """One Engine's running estimate of a plain step's wall time (a target forward over one token)."""

    def __init__(self) -> None:
        self.seconds: float | None = None

    def observe(self, seconds: float) -> None:
        self.seconds = seconds if self.seconds is None else self.seconds + PLAIN_SMOOTHING * (seconds - self.seconds)


class SpeedGuard:
    """One request's guard: `budget` before each step says how many tokens to draft, `observe` after it."""

    def __init__(self, clock: PlainStepClock, enabled: bool) -> None:
        self.clock = clock
        self.enabled = enabled
        self.cap: int | None = None  # the most tokens to draft while shrinking; None = as the drafter asks
        self.paused_steps_left = 0
        self.next_pause = FIRST_PAUSE
        # The first drafting step after a start or a pause pays the drafter's catch-up. So does a step where a
        # member of a combination reads a context it deferred or fell behind on (`caught_up`): one draft model
        # catch-up in a window of 8 steps paused `auto` for 80 of a 512-token answer's steps (#62: a fresh process
        # per answer, coding).
        self.warming = True
        self.window_seconds = 0.0
        self.window_tokens = 0
        self.window_steps = 0
        self.last_budget = 0
        self.shrinks = 0  # verdicts that halved the draft length
        self.pauses = 0  # verdicts that paused drafting

    def budget(self, wanted: int) -> tuple[int, str | None]:
        """Tokens to draft this step (<= wanted) and, when the guard withholds all of them, why."""
        if not self.enabled or wanted <= 0:
            self.last_budget = wanted
            return wanted, None
        if self.paused_steps_left > 0:
            self.last_budget = 0
            return 0, "guard_paused"
        if self.clock.seconds is None and self.window_steps >= WINDOW:
            self.last_budget = 0
            return 0, "guard_timing_plain"  # one plain step gives the estimate a verdict needs
        self.last_budget = wanted if self.cap is None else min(wanted, self.cap)
        return self.last_budget, None

    def observe(self, seconds: float, committed: int, drafted: int, drafting_seconds: float = 0.0,
                caught_up: bool = False) -> None:
        """After a step of `seconds` (drafting, verifying, committing), `drafting_seconds` of them spent asking
        for drafts, that committed `committed` tokens and verified `drafted` drafted nodes; `caught_up`: its
        drafter first read a context it had deferred or fallen behind on (DraftProposal.caught_up), a one-off left
        out like the first drafting step after a start."""
        if drafted == 0:
            # The plain step is the forward alone: a drafter that ran and proposed nothing must not make plain
            # decoding look slower, or speculation that pays nothing would never measure below it.
            self.clock.observe(seconds - drafting_seconds)
        if not self.enabled:
            return
        if self.paused_steps_left > 0:
            self.paused_steps_left -= 1
            return
        if self.last_budget == 0:
            return  # the plain step that timed the clock, or no room left to draft
        if self.warming or caught_up:
            self.warming = False
            return
        self.window_seconds += seconds
        self.window_tokens += committed
        self.window_steps += 1
        if self.window_steps >= WINDOW and self.clock.seconds is not None:
            self._verdict()

    def _verdict(self) -> None:
        speculative_rate = self.window_tokens / self.window_seconds  # tokens per second with drafts
        plain_rate = 1.0 / self.clock.seconds
        self.window_seconds, self.window_tokens, self.window_steps = 0.0, 0, 0
        if speculative_rate >= plain_rate:
            self.next_pause = FIRST_PAUSE
            if self.cap is not None:
                self.cap += 1  # win back length one token at a time
            return
        if self.last_budget > 1:
            self.cap = self.last_budget // 2
            self.shrinks += 1
            return
        self.cap = 1  # probes resume at the length that lost last; a passing probe wins length back
        self.paused_steps_left = self.next_pause
        self.next_pause = min(2 * self.next_pause, MAX_PAUSE)
        self.warming = True
        self.pauses += 1


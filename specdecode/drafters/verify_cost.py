"""What a verify forward costs, learnt online for per-step choice (step_choice.py): seconds as a line in what the
forward reads.

A dense target's forward reads every weight once whatever its rows, and each row adds a little: the line is in the
drafted nodes. A mixture of experts reads the union of its rows' experts, each once (decoder/moe.py), so a forward
of 8 rows on a 128-expert, top-8 model reads about 52 experts a layer where one row reads 8 (uniform routing), and
its seconds follow those experts, not the rows (docs/benchmarks: verify time within 6-12% of a line in distinct
experts on three shapes). There the line is in the distinct experts per sparse layer that the model's tally counted
(ExpertTally), and a draft is priced by the experts its rows are expected to touch: learnt per row count from the
tallies of past verify forwards, and for a row count not seen yet, uniform routing's count scaled by how far the
seen counts fell below theirs (trained routers send neighbouring tokens to the same experts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specdecode.models.decoder.moe import ExpertTally

SMOOTHING = 0.2  # weight of the newest observation in every running estimate here


class LineFit:
    """seconds = a + b * x, fitted by exponentially weighted least squares. Before two different x were seen there
    is no slope to fit: every x costs the mean seen (`proportional` False: rows are cheap next to the weights), or
    the mean in proportion to x (True: the experts are most of what a forward reads, and a draft priced as free
    would never try the shorter depths whose timings teach the slope).
    A line that is not proportional never predicts less than the cheapest x costs on average: there the weights
    are most of a forward, and a slope fitted on the noise of drafts of 1-6 nodes (a 6-node forward that took 250 ms
    where the others took 120-160) put a plain step at 14-45 ms against the 120-200 ms it took (bf16, #62), so
    per-step choice promised plain decoding several times its speed."""

    def __init__(self, proportional: bool = False) -> None:
        self.proportional = proportional
        self.weight = self.x = self.seconds = self.x_sq = self.x_seconds = 0.0
        # Not proportional: x (drafted nodes, a few distinct counts) -> running mean of its seconds, the floor.
        self.by_x: dict[float, float] = {}

    def observe(self, x: float, seconds: float) -> None:
        if not self.proportional:
            known = self.by_x.get(x)
            self.by_x[x] = seconds if known is None else known + SMOOTHING * (seconds - known)
        keep = 1 - SMOOTHING
        self.weight = keep * self.weight + 1
        self.x = keep * self.x + x
        self.seconds = keep * self.seconds + seconds
        self.x_sq = keep * self.x_sq + x * x
        self.x_seconds = keep * self.x_seconds + x * seconds

    def predict(self, x: float) -> float:
        if self.weight == 0:
            return 0.0
        mean_x, mean_seconds = self.x / self.weight, self.seconds / self.weight
        variance = self.x_sq / self.weight - mean_x**2
        if variance <= 1e-6:
            line = mean_seconds * x / mean_x if self.proportional and mean_x > 0 else mean_seconds
        else:
            slope = max(0.0, (self.x_seconds / self.weight - mean_x * mean_seconds) / variance)
            line = mean_seconds + slope * (x - mean_x)
        return max(line, 0.0) if self.proportional else max(line, min(self.by_x.values()))


def uniform_touched(num_experts: int, per_token: int, rows: int) -> float:
    """Expected distinct experts of `rows` rows each routed to `per_token` of `num_experts` experts at random."""
    return num_experts * (1.0 - (1.0 - per_token / num_experts) ** rows)


class ExpertsByRows:
    """Distinct experts per sparse layer that a forward of so many rows touches, learnt from the tally."""

    def __init__(self, num_experts: int, per_token: int) -> None:
        self.num_experts, self.per_token = num_experts, per_token
        self.seen: dict[int, float] = {}  # rows -> running mean of the distinct experts counted
        self.ratio = 1.0  # running mean of counted / uniform routing's count, over every forward seen

    def observe(self, rows: int, touched: float) -> None:
        known = self.seen.get(rows)
        self.seen[rows] = touched if known is None else known + SMOOTHING * (touched - known)
        self.ratio += SMOOTHING * (touched / self.uniform(rows) - self.ratio)

    def predict(self, rows: int) -> float:
        known = self.seen.get(rows)
        return known if known is not None else min(self.num_experts, self.ratio * self.uniform(rows))

    def uniform(self, rows: int) -> float:
        return uniform_touched(self.num_experts, self.per_token, max(1, rows))


class VerifyCost:
    """Seconds of a verify step with `nodes` drafted nodes: a line in the nodes, or on a mixture of experts (a
    tally given) in the distinct experts that many rows touch (the nodes and the token before them)."""

    def __init__(self, tally: ExpertTally | None = None) -> None:
        self.line = LineFit(proportional=tally is not None)
        self.tally = tally
        self.experts = None if tally is None else ExpertsByRows(tally.num_experts, tally.experts_per_token)

    @property
    def priced_by_experts(self) -> bool:
        return self.experts is not None

    def observe(self, nodes: int, seconds: float) -> None:
        """After a verify forward of `nodes` drafted nodes that took `seconds`, its experts read from the tally."""
        if self.experts is None:
            self.line.observe(nodes, seconds)
            return
        touched = self.tally.last()
        self.experts.observe(nodes + 1, touched)
        self.line.observe(touched, seconds)

    def predict(self, nodes: int) -> float:
        return self.line.predict(nodes if self.experts is None else self.experts.predict(nodes + 1))

"""A request's prompt read into the target a chunk at a time.

A server that batches requests must read each arriving prompt before the request can join the batch, and a
whole prompt of 150 tokens costs about a second on 2 cores: every request already decoding waits that long for
its next token (docs/benchmarks, 2026-12-04: inter-token p99 0.9-1.3 s at 4-8 clients). Read `chunk` tokens at
a time, one chunk between two batched steps, that stall is a chunk's worth. The chunks' forwards append to the
request's KV cache as a verify forward does, and the drafter is started once, on the whole prompt's hidden
states, so what the request decodes does not depend on the chunking (bitwise on a w4a8 target, whose kernels
give a row the same bits whatever rows share its forward; tests/test_drafter_contract.py).
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter

import torch

from specdecode.spec_types import Sequence, TargetOutput
from specdecode.tree import ForwardInputs


class Prefill:
    """`advance` reads the next chunk; the last one samples the first token and starts the drafter."""

    def __init__(self, seq: Sequence, chunk: int | None, device: torch.device,
                 forward: Callable[[Sequence, ForwardInputs], TargetOutput],
                 started: Callable[[Sequence, TargetOutput, float], None], reused: TargetOutput | None = None):
        """`forward(seq, inputs)`: one target forward with the hidden states the drafter reads, logits of the
        last row; `started(seq, whole prompt's output, target seconds)`: what follows the prompt's read;
        `reused`: the hidden states of the prompt's first rows, already in the cache from the prefix cache."""
        self.seq = seq
        self.chunk = chunk if chunk else seq.prompt_len  # None or 0: the whole prompt in one forward
        self.device = device
        self.read = seq.cache.lengths[0]  # prompt tokens in the KV cache so far
        self.target_seconds = 0.0
        self._forward, self._started = forward, started
        self._parts: list[TargetOutput] = [] if reused is None else [reused]

    @property
    def done(self) -> bool:
        return self.read == self.seq.prompt_len

    @torch.inference_mode()
    def advance(self) -> bool:
        """Read the next chunk of the prompt; -> True once the whole prompt is read and the request started."""
        prompt = self.seq.tokens[: self.seq.prompt_len]
        end = min(self.read + self.chunk, len(prompt))
        inputs = ForwardInputs(torch.tensor([prompt[self.read : end]], device=self.device),
                               torch.arange(self.read, end, device=self.device).unsqueeze(0), None)  # [1, C] each
        began = perf_counter()
        self._parts.append(self._forward(self.seq, inputs))
        self.target_seconds += perf_counter() - began
        self.read = end
        if self.done:
            self._started(self.seq, TargetOutput.joined(self._parts), self.target_seconds)
            self._parts.clear()
        return self.done

    def run(self) -> Sequence:
        """Read what is left of the prompt; -> the started request."""
        while not self.advance():
            pass
        return self.seq


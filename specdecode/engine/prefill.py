"""A request's prompt read into the target, whole or a chunk at a time.

A server must read each arriving prompt before the request can join the others, and a whole prompt holds up every
request already decoding for as long as its forward takes. Read a chunk at a time, one chunk between two rounds of
steps (server/scheduler.py), that stall is a chunk's worth. The chunks' forwards append to the request's
KV cache as a verify forward does, and the drafter is started once, on the whole prompt's hidden states, so what
the request decodes does not depend on the chunking (bitwise on a w4a8 target, whose kernels give a row the same
bits whatever rows share its forward; tests/drafters/test_drafter_contract.py).
"""

from __future__ import annotations

import torch

from specdecode.engine.forward import forward_rows
from specdecode.engine.request import Request
from specdecode.models.decoder.forward_inputs import ForwardInputs
from specdecode.models.decoder.transformer import Transformer
from specdecode.spec_types import TargetOutput


def read_chunk(model: Transformer, request: Request, tokens: int) -> TargetOutput | None:
    """Read the next `tokens` tokens of the prompt into the target's cache; -> the whole prompt's output (its
    hidden states at every row, the last row's logits) once it is all read, else None."""
    read = request.cache.lengths[0]  # prompt tokens in the KV cache so far (a prefix cache hit included)
    end = min(read + tokens, request.prompt_len)
    device = model.device
    inputs = ForwardInputs(torch.tensor([request.tokens[read:end]], device=device),
                           torch.arange(read, end, device=device).unsqueeze(0), None)  # [1, C] each
    request.prompt_parts.append(forward_rows(model, request, inputs, logits_at=slice(-1, None)))
    if end < request.prompt_len:
        return None
    whole = TargetOutput.joined(request.prompt_parts)
    request.prompt_parts.clear()
    return whole

"""Run requests the way the server's batched scheduler does: Engine.step_many over every active request, new
ones joining between steps and finished ones leaving."""

from __future__ import annotations

from specdecode import Engine


def run_batched(engine: Engine, requests: list[tuple], join_every: int = 2) -> tuple[list[list[int]], list[tuple]]:
    """requests: (prompt, sampling, spec) each; one joins every `join_every` steps, in order.
    -> each request's generated ids (as Engine.complete would return them), and the [B, T] shape of every
    batched forward (so a test can check that drafts were verified in batches)."""
    shapes = []
    forward_batch = engine._forward_batch

    def recording(seqs, inputs):
        shapes.append(tuple(inputs.tokens.shape))
        return forward_batch(seqs, inputs)

    engine._forward_batch = recording
    try:
        return _run(engine, requests, join_every), shapes
    finally:
        del engine._forward_batch


def admit(engine: Engine, index: int, request: tuple, active: list, outputs: list[list[int]]) -> None:
    """Open request `index` (prompt, sampling, spec): its first token goes to outputs[index]; it joins `active`
    ((index, stream) pairs) unless that token already ended it."""
    stream = engine.open(*request)
    event = stream.first_event()
    outputs[index].extend(event.token_ids)
    if event.finish_reason is None:
        active.append((index, stream))
    else:
        engine.finish(stream.seq)


def step_active(engine: Engine, active: list, outputs: list[list[int]]) -> None:
    """One Engine.step_many over every active stream; each one's tokens go to its output, finished ones leave."""
    committed = engine.step_many([stream.seq for _, stream in active])
    for (index, stream), tokens in zip(list(active), committed):
        event = stream.event(tokens)
        outputs[index].extend(event.token_ids)
        if event.finish_reason is not None:
            engine.finish(stream.seq)
            active.remove((index, stream))


def _run(engine: Engine, requests: list[tuple], join_every: int) -> list[list[int]]:
    outputs: list[list[int]] = [[] for _ in requests]
    waiting = list(enumerate(requests))
    active = []  # (index, stream)
    steps = 0
    while waiting or active:
        if waiting and steps % join_every == 0:
            admit(engine, *waiting.pop(0), active, outputs)
        if active:
            step_active(engine, active, outputs)
        steps += 1
    return outputs

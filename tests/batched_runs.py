"""Run requests the way the server's batched scheduler does: Engine.step_many over every active request, new
ones joining between steps and finished ones leaving."""

from __future__ import annotations

from specdecode import Engine
from specdecode.engine import forward


def run_batched(engine: Engine, requests: list[tuple], join_every: int = 2) -> tuple[list[list[int]], list[tuple]]:
    """requests: (prompt, sampling, spec) each; one joins every `join_every` steps, in order.
    -> each request's generated ids (as Engine.complete would return them), and the [B, T] shape of every
    batched forward (so a test can check that drafts were verified in batches)."""
    shapes = []
    forward_batch = forward._forward_batch

    def recording(model, seqs, inputs):
        shapes.append(tuple(inputs.tokens.shape))
        return forward_batch(model, seqs, inputs)

    forward._forward_batch = recording
    try:
        return _run(engine, requests, join_every), shapes
    finally:
        forward._forward_batch = forward_batch


def admit(engine: Engine, index: int, request: tuple, active: list, outputs: list[list[int]]) -> None:
    """Begin request `index` (prompt, sampling, spec): its first token goes to outputs[index]; it joins `active`
    ((index, request) pairs) unless that token already ended it."""
    prompt, sampling, spec = request
    begun = engine.begin(engine.encode(prompt), sampling, spec)
    event = engine.prefill(begun)
    outputs[index].extend(event.token_ids)
    if event.finish_reason is None:
        active.append((index, begun))
    else:
        engine.finish(begun)


def step_active(engine: Engine, active: list, outputs: list[list[int]]) -> None:
    """One Engine.step_many over every active request; each one's tokens go to its output, finished ones leave."""
    events = engine.step_many([request for _, request in active])
    for (index, request), event in zip(list(active), events):
        outputs[index].extend(event.token_ids)
        if event.finish_reason is not None:
            engine.finish(request)
            active.remove((index, request))


def _run(engine: Engine, requests: list[tuple], join_every: int) -> list[list[int]]:
    outputs: list[list[int]] = [[] for _ in requests]
    waiting = list(enumerate(requests))
    active = []  # (index, request)
    steps = 0
    while waiting or active:
        if waiting and steps % join_every == 0:
            admit(engine, *waiting.pop(0), active, outputs)
        if active:
            step_active(engine, active, outputs)
        steps += 1
    return outputs


def drafts_in_shared_forwards(engine: Engine, spec, temperature: float, owner, name: str, monkeypatch) -> list:
    """Each of four prompts decoded alone, then all batched (one joining per step), with the load budget held
    open so that every sequence drafts what it would alone (spec should turn the guard off): outputs must be
    equal, seeded sampling included. -> (args, kwargs) of every call of owner.`name` in the batched run."""
    from specdecode import SamplingParams

    monkeypatch.setattr(engine.load_budget, "draft_cap", lambda seqs, wanted: max(wanted))
    prompts = ["hello hello hello", "abcabcabc abcabc", "The quick brown fox", "1 2 3 1 2 3 1 2"]
    requests = [(p, SamplingParams(max_tokens=20, temperature=temperature, seed=i, ignore_eos=True), spec)
                for i, p in enumerate(prompts)]
    alone = [engine.complete(*request).token_ids for request in requests]
    calls = []
    original = getattr(owner, name)

    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, recording)
    batched, _ = run_batched(engine, requests, join_every=1)
    assert batched == alone
    return calls


def assert_padded_rows_keep_their_bits(forward, new_cache, width: int, dtype) -> None:
    """forward(tokens [B, T], hidden [B, T, H], positions [B, T], cache) -> (logits [B, T, V], fed-back
    [B, T, H]), a drafter's one-layer forward over caches from new_cache(). Rows read together with a sequence of
    another length (its cache and its new rows, padded as a batched catch-up pads them) must get bitwise the
    logits and fed-back states they get alone (the PyTorch attention over a padded batch does not promise that)."""
    import torch

    from specdecode.models.decoder.kv_cache import CacheBatch

    generator = torch.Generator().manual_seed(0)
    cached, new = (7, 40), (3, 8)  # rows each sequence's cache holds, rows each reads now

    def inputs(rows: int, start: int):
        tokens = torch.randint(0, 200, (1, rows), generator=generator)  # [1, R]
        hidden = torch.randn(1, rows, width, generator=generator).to(dtype)  # [1, R, H]
        return tokens, hidden, torch.arange(start, start + rows)[None]

    first = [inputs(n, 0) for n in cached]
    second = [inputs(n, c) for n, c in zip(new, cached)]

    def primed(b: int):
        cache = new_cache()
        forward(*first[b], cache)
        return cache

    with torch.inference_mode():
        alone = [forward(*second[b], primed(b)) for b in range(2)]
        padded = [torch.cat([part, part[:, -1:].expand(-1, new[1] - new[0], *part.shape[2:])], dim=1)
                  for part in second[0]]  # sequence 0's rows padded to sequence 1's count with copies of its last
        tokens, hidden, positions = (torch.cat([padded[i], second[1][i]]) for i in range(3))
        logits, fed_back = forward(tokens, hidden, positions, CacheBatch([primed(0), primed(1)]))
    for b, n in enumerate(new):
        assert torch.equal(logits[b, :n], alone[b][0][0]) and torch.equal(fed_back[b, :n], alone[b][1][0])

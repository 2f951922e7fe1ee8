"""draft_lookup: each chain forward of a draft model also reads the tokens prompt lookup guesses come next, so
that where the draft's own next tokens are those guesses, one forward drafts several. On a batch-invariant draft
(w4a8: a row's logits do not depend on the rows beside it) the drafts are exactly those of one token per forward,
greedy and sampled, in fewer forwards. Greedy identity and the distribution test over every drafter
(test_drafter_contract.py) run with the default draft_lookup; batches of chains with it in test_batching.py."""

from __future__ import annotations

import pytest
from conftest import save_tiny_model

from specdecode import Engine, SamplingParams, SpecConfig
from specdecode.models.kernels.w4a8_linear import w4a8_unavailable
from specdecode.models.loader import load_model

PROMPTS = ["hello hello hello", "1 2 3 1 2 3 1 2", "The quick brown fox"]
SAMPLINGS = {"greedy": SamplingParams(max_tokens=48, ignore_eos=True),
             "sampled": SamplingParams(max_tokens=48, ignore_eos=True, temperature=0.3, seed=5)}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    reason = w4a8_unavailable()
    if reason is not None:
        pytest.skip(f"w4a8 cannot run on this machine: {reason}")
    root = tmp_path_factory.mktemp("lookup")
    target = save_tiny_model(root / "target", "qwen2", scale=0.15)
    draft = save_tiny_model(root / "draft", "qwen2", scale=0.15, noise=0.01)
    return Engine(load_model(target, dtype="bfloat16", quant="w4a8"),
                  load_model(draft, dtype="bfloat16", quant="w4a8"))


def drafted(engine: Engine, prompt: str, sampling: SamplingParams, lookup: int, monkeypatch):
    """(output tokens, every chain the draft proposed, draft forwards) of one request with draft_lookup `lookup`."""
    spec = SpecConfig("draft", num_draft_tokens=6, guard=False, options={"draft_lookup": lookup})
    drafter = engine.drafter(spec)
    chains, forwards = [], [0]
    propose = drafter._chains

    def recording(*args):
        proposals = propose(*args)
        chains.extend((p.tokens.tolist(), None if p.probs is None else p.probs.tolist()) for p in proposals)
        return proposals

    monkeypatch.setattr(drafter, "_chains", recording)
    hook = engine.draft.model.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    try:
        tokens = engine.complete(prompt, sampling, spec).token_ids
    finally:
        hook.remove()
    return tokens, chains, forwards[0]


@pytest.mark.parametrize("kind", SAMPLINGS)
def test_guesses_change_no_draft_and_save_draft_forwards(engine, monkeypatch, kind):
    forwards = {0: 0, 3: 0}
    for prompt in PROMPTS:
        runs = {lookup: drafted(engine, prompt, SAMPLINGS[kind], lookup, monkeypatch) for lookup in forwards}
        tokens, chains, _ = runs[0]
        assert chains and any(len(chain) > 1 for chain, _ in chains)
        assert runs[3][:2] == (tokens, chains), prompt  # the same output from the same drafts, q included
        for lookup, (_, _, count) in runs.items():
            forwards[lookup] += count
    # The tiny draft repeats itself as a greedy small model does, and the guesses follow it there.
    assert forwards[3] < forwards[0], forwards

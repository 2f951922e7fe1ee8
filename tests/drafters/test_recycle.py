"""Token Recycling (drafters/recycle.py): the adjacency matrix learns every row of each verify forward, the
rejected drafts' included; drafts walk it as a chain or fill the static tree template; it is shared across an
Engine's requests or kept per request; its memory is reported. Greedy identity, distribution, batches and the
prefix cache are the contract suite's (tests/drafters/test_drafter_contract.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import started

from specdecode import Engine, SamplingParams, SpecConfig, SpecDecodeError
from specdecode.drafters.recycle import UNSEEN, RecycleDrafter, RecycleOptions, static_template
from specdecode.drafters.registry import resolve_spec, with_serve_defaults
from specdecode.spec_types import TargetOutput

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(noisy_pair):
    return Engine(noisy_pair[0])


def test_every_row_of_a_verify_forward_is_learnt_the_rejected_ones_too():
    drafter = RecycleDrafter(10, RecycleOptions(recycle_topk=2))
    logits = torch.full((3, 10), -5.0)  # [T, V] rows for the fed tokens 4, 7, 1
    logits[0, [2, 3]] = torch.tensor([9.0, 8.0])
    logits[1, [5, 6]] = torch.tensor([8.0, 9.0])
    logits[2, [0, 9]] = torch.tensor([7.0, 6.0])
    drafter.observe(None, torch.tensor([4, 7, 1]), TargetOutput(logits))
    assert drafter.shared[4].tolist() == [2, 3] and drafter.shared[7].tolist() == [6, 5]
    assert drafter.shared[1].tolist() == [0, 9] and drafter.shared[0].tolist() == [UNSEEN, UNSEEN]


def test_a_chain_follows_each_tokens_best_successor_until_an_unseen_one():
    drafter = RecycleDrafter(10, RecycleOptions(recycle_topk=2))
    drafter.shared[[3, 5, 8]] = torch.tensor([[5, 1], [8, 2], [UNSEEN, UNSEEN]], dtype=torch.int32)

    class Request:
        tokens = [0, 3]
        drafter_state: dict = {}

    assert drafter.propose(Request(), 5).tokens.tolist() == [5, 8]
    assert drafter.propose(Request(), 1).tokens.tolist() == [5]


def test_the_tree_template_puts_likely_nodes_first_and_parents_before_children():
    template = static_template(16, 8)
    assert len(template) == 16 and template[0] == (-1, 0, 1)  # the best successor of the last token first
    for index, (parent, rank, depth) in enumerate(template):
        assert parent < index and (parent == -1 or template[parent][2] == depth - 1)
    assert max(depth for _, _, depth in template) >= 3 and sum(parent == -1 for parent, _, _ in template) >= 3


def test_a_tree_fills_the_template_within_the_draft_budget():
    drafter = RecycleDrafter(10, RecycleOptions(recycle_topk=3, recycle_tree_nodes=8))
    drafter.shared[:] = torch.tensor([[(t + 1) % 10, (t + 2) % 10, (t + 3) % 10] for t in range(10)])

    class Request:
        tokens = [0]
        drafter_state: dict = {}

    proposal = drafter.propose(Request(), 2)
    parents = proposal.parent_list()
    depth = {-1: 0}
    for node, parent in enumerate(parents):
        depth[node] = depth[parent] + 1
        start = 0 if parent == -1 else int(proposal.tokens[parent])
        assert int(proposal.tokens[node]) in {(start + 1) % 10, (start + 2) % 10, (start + 3) % 10}
    assert 1 < proposal.size <= 8 and max(depth.values()) <= 2
    assert proposal.tokens[0] == 1 and parents[0] == -1


def test_the_matrix_outlives_a_request_unless_a_server_keeps_it_per_request(engine):
    spec = SpecConfig("recycle")
    engine.complete("hello hello hello", GREEDY, spec)
    drafter = engine.drafter(spec)
    assert (drafter.shared[:, 0] != UNSEEN).sum() > 0 and engine.drafter_cache_bytes() >= drafter.shared.nbytes
    served = resolve_spec(with_serve_defaults(spec))
    assert served.option("recycle_shared") is False
    request = started(engine, engine.encode("hello hello hello"), GREEDY, served)
    engine.step(request)
    assert engine.drafter(served).shared is None and request.drafter.request_bytes(request) > 0
    engine.finish(request)
    assert not request.drafter_state


def test_recycled_drafts_are_accepted_on_text_the_target_repeats(engine):
    """The first answer fills the matrix; the same prompt again drafts what the target said, and its drafts are
    accepted (on the tiny model, whose text loops)."""
    spec = SpecConfig("recycle", num_draft_tokens=4, guard=False)
    fresh = Engine(engine.target)
    fresh.complete("abc abc abc", GREEDY, spec)
    again = fresh.complete("abc abc abc", GREEDY, spec)
    assert again.stats.accepted_tokens > 0 and again.token_ids == fresh.complete("abc abc abc", GREEDY).token_ids


@pytest.mark.parametrize("bad", [{"recycle_topk": 0}, {"recycle_tree_nodes": 129}])
def test_bad_options_are_one_clear_error(bad):
    with pytest.raises(SpecDecodeError, match=next(iter(bad))):
        resolve_spec(SpecConfig("recycle", options=bad))


def test_auto_leaves_it_out(engine):
    """It measured 0.99x plain decoding on unseen prompts (#62): auto runs without it, a named chain with it."""
    assert "recycle" not in engine.check_spec(SpecConfig("auto")).method.split(",")
    assert engine.check_spec(SpecConfig("suffix,recycle", combine="best")).method == "suffix,recycle"

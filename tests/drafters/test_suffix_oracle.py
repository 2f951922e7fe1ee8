"""Suffix decoding against its reference implementation: Arctic Inference's suffix trees (arctic-inference 0.3.0,
the code vLLM's `suffix` method runs) on 240 generated cases, paths and trees, with and without earlier responses
cached. Its answers were written by tests/fixtures/suffix_arctic/make_fixtures.py in an environment of its own."""

from __future__ import annotations

import json
import math

import pytest
from conftest import FIXTURES_ROOT

from specdecode.drafters.suffix import SuffixDrafter, SuffixOptions

CASES = json.loads((FIXTURES_ROOT / "suffix_arctic" / "cases.json").read_text())["cases"]


def ours(case: dict):
    params, budget = case["params"], case["params"]["max_spec_tokens"]
    drafter = SuffixDrafter(SuffixOptions(
        suffix_max_depth=params["max_tree_depth"], suffix_spec_factor=params["max_spec_factor"],
        suffix_min_prob=params["min_token_prob"], suffix_cache_requests=1000,
        suffix_tree_nodes=budget if params["use_tree_spec"] else 0))
    for response in case["responses"]:
        drafter.cache.add(response)
    return drafter.candidate(case["context"], budget)


def test_the_cases_cover_paths_trees_the_cache_and_empty_drafts():
    assert any(c["params"]["use_tree_spec"] for c in CASES) and not all(c["params"]["use_tree_spec"] for c in CASES)
    assert sum(bool(c["responses"]) for c in CASES) > 50
    assert sum(not c["arctic"]["token_ids"] for c in CASES) > 0
    assert sum(len(set(c["arctic"]["parents"])) < len(c["arctic"]["parents"]) for c in CASES) > 10  # branching


@pytest.mark.parametrize("index", range(len(CASES)))
def test_same_draft_as_the_reference(index):
    case, reference = CASES[index], CASES[index]["arctic"]
    candidate = ours(case)
    assert candidate.tokens == reference["token_ids"]
    assert candidate.parents == reference["parents"]
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(candidate.probs, reference["probs"]))
    if reference["token_ids"]:
        assert candidate.match_len == reference["match_len"]
        assert math.isclose(candidate.score, reference["score"], rel_tol=1e-5)

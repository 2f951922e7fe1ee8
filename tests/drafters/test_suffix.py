"""Suffix decoding: occurrence search, continuation counts and trees, the response cache and its bound, the
cache's reach across requests and its default in `serve`. Losslessness is the drafter contract suite's."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import save_tiny_model

from specdecode import Engine, SamplingParams, SpecConfig
from specdecode.drafters.registry import resolve_spec, with_serve_defaults
from specdecode.drafters.suffix import ResponseCache, SuffixOptions
from specdecode.drafters.suffix_index import TokenIndex, best_candidate, matches, path_candidate, tree_candidate
from specdecode.errors import SpecDecodeError
from specdecode.models.loader import load_model

# "1 2 3" occurs four times (the context's own end included), followed by 4, 5 and 4.
CONTEXT = np.array([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4, 9, 1, 2, 3])


def ends_of(tokens: np.ndarray, pattern: list[int]) -> np.ndarray:
    return np.flatnonzero(tokens == pattern[-1])


def test_matches_narrow_by_one_token_a_step_and_count_every_occurrence():
    pattern = CONTEXT.tolist()
    found = [(m, positions.tolist()) for m, positions in matches(CONTEXT, ends_of(CONTEXT, pattern), pattern, 8)]
    # The context's own end is an occurrence too (as in a suffix tree); "9 1 2 3" and longer occur only there.
    assert found == [(m, [2, 6, 10, 15]) for m in (1, 2, 3)] + [(m, [15]) for m in range(4, 9)]


def test_matches_never_cross_a_separator():
    index = TokenIndex([np.array([7, 1]), np.array([2, 5])])  # "1 2" only across the boundary
    assert [m for m, _ in matches(index.tokens, index.positions_of(2), [1, 2], 4)] == [1]


def test_path_follows_the_most_frequent_child_with_its_share_of_the_occurrences():
    candidate = path_candidate(CONTEXT, np.array([2, 6, 10, 15]), 3, max_tokens=3, room=8, min_prob=0.0)
    # 4 follows two of the four occurrences; after "1 2 3 4", 1 and 9 once each: the first seen goes first.
    assert candidate.tokens == [4, 1, 2]
    assert candidate.parents == [-1, 0, 1]
    assert candidate.probs == pytest.approx([2 / 4, 1 / 4, 1 / 4])


def test_equal_counts_go_to_the_latest_to_reach_them_once_counted_twice():
    tokens = np.array([0, 7, 0, 8, 0, 8, 0, 7, 0])  # after 0: 7 at 1 and 7; 8 at 3 and 5; 7 reached 2 last
    assert path_candidate(tokens, ends_of(tokens, [0]), 1, 1, 8, 0.0).tokens == [7]


def test_tree_takes_the_most_probable_nodes_with_parents_first():
    candidate = tree_candidate(CONTEXT, np.array([2, 6, 10, 15]), 3, max_tokens=3, max_depth=3, room=8, min_prob=0.0)
    assert candidate.tokens == [4, 5, 1] and candidate.parents == [-1, -1, 0]
    assert candidate.probs == pytest.approx([2 / 4, 1 / 4, 1 / 4])


def test_min_prob_and_the_depth_bound_cut_the_draft():
    assert path_candidate(CONTEXT, np.array([2, 6, 10, 15]), 3, 3, 8, min_prob=0.3).tokens == [4]
    assert path_candidate(CONTEXT, np.array([2, 6, 10, 15]), 3, 3, room=1, min_prob=0.0).tokens == [4]


def test_proposal_length_grows_with_the_match_length():
    tokens = np.array([0, 1, 2, 3, 4, 5, 6, 7, 9, 0, 1, 2, 3])  # "0 1 2 3" occurred once before
    pattern = tokens.tolist()

    def best(max_depth: int, budget: int, spec_factor: float):
        return best_candidate(tokens, ends_of(tokens, pattern), pattern, max_depth, budget, spec_factor, 0, 0.0)

    assert (best(2, 8, 1.0).match_len, best(2, 8, 1.0).tokens) == (1, [4])  # only 1-token matches fit depth 2
    assert (best(24, 8, 1.0).match_len, best(24, 8, 1.0).tokens) == (4, [4, 5, 6, 7])
    assert best(24, 8, 1.0).probs == pytest.approx([0.5] * 4)  # the context's own end is the other occurrence
    assert best(24, 2, 4.0).tokens == [4, 5]  # the budget bounds the depth whatever the factor


def test_nothing_to_propose_without_an_earlier_occurrence():
    tokens = np.array([5, 6, 7])
    assert best_candidate(tokens, ends_of(tokens, [7]), [5, 6, 7], 8, 4, 1.0, 0, 0.1).tokens == []


def test_response_cache_is_first_in_first_out_and_reports_its_size():
    cache = ResponseCache(limit=2)
    for response in ([1, 2, 3], [4, 5], [6]):
        cache.add(response)
    assert [r.tolist() for r in cache.responses] == [[4, 5], [6]]
    assert cache.tokens == 3
    assert cache.index.tokens.tolist() == [4, 5, -1, 6, -1]
    assert cache.bytes == 3 * 5 * 8
    off = ResponseCache(limit=0)
    off.add([1, 2])
    assert not off.responses


@pytest.mark.parametrize("bad", [{"suffix_max_depth": 0}, {"suffix_spec_factor": 0.0}, {"suffix_min_prob": 1.5},
                                 {"suffix_cache_requests": -1}, {"suffix_tree_nodes": 65}])
def test_option_values_out_of_range_are_clear_errors(bad):
    with pytest.raises(SpecDecodeError, match=next(iter(bad))):
        resolve_spec(SpecConfig("suffix", options=bad))


def test_serve_turns_the_cross_request_cache_off_unless_asked():
    assert dict(with_serve_defaults(SpecConfig("suffix")).options)["suffix_cache_requests"] == 0
    asked = with_serve_defaults(SpecConfig("suffix", suffix_cache_requests=50))
    assert dict(asked.options)["suffix_cache_requests"] == 50
    assert SuffixOptions().suffix_cache_requests > 0  # on for generate and the Python API


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    target = load_model(save_tiny_model(tmp_path_factory.mktemp("suffix") / "target", "qwen2", scale=0.15),
                        dtype="float32")
    return Engine(target)


@pytest.mark.parametrize("cached", [1000, 0])
def test_an_earlier_response_drafts_a_repeated_request_only_with_the_cache(engine, cached):
    """Asked the same thing twice, the second request drafts from the first's response when the cache is on:
    more tokens accepted, the same output either way."""
    sampling = SamplingParams(max_tokens=40, ignore_eos=True)
    spec = SpecConfig("suffix", num_draft_tokens=4, adaptive=False, suffix_cache_requests=cached,
                      suffix_spec_factor=4.0)
    prompt = "The quick brown fox"
    first = engine.complete(prompt, sampling, spec)
    second = engine.complete(prompt, sampling, spec)
    assert second.token_ids == first.token_ids == engine.complete(prompt, sampling, SpecConfig("none")).token_ids
    if cached:
        assert second.stats.accepted_tokens > first.stats.accepted_tokens
        assert second.stats.target_forwards < first.stats.target_forwards
        assert second.stats.drafter_cache_bytes > first.stats.drafter_cache_bytes > 0  # reported, and growing
    else:
        assert second.stats.accepted_tokens == first.stats.accepted_tokens
        assert second.stats.drafter_cache_bytes == 0

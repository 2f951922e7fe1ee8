"""Trees, verified in one forward: the greedy path, the inputs of the forward, and the sibling rule's law.

The law check: a toy target whose next-token logits depend on the depth and the previous token (a table), and
hand-built trees of two levels (three children at the root, two under each). Each trial verifies one tree and
records the first two committed tokens; when a step commits only one, the second comes straight from the
target's conditional (what a later step's first token follows). Truth: p(y1) p(y2 | y1). A chi-square test
at alpha = 1e-4 on the joint and both marginals, over 20,000 trials, must pass for the real rule, with siblings
drawn from q or deterministic (top-k, duplicates included), and must fail for a wrong rule.
"""

from __future__ import annotations

import pytest
import torch
from test_verify_distribution import SETTINGS, _chi_square

from specdecode.acceptance.sampling import logits_to_probs, sample
from specdecode.acceptance.tree import ancestor_mask, check_parents, children_of, depths, tree_from_paths
from specdecode.acceptance.verify import verify
from specdecode.config import SamplingParams
from specdecode.engine.forward import verify_inputs
from specdecode.errors import SpecDecodeError
from specdecode.spec_types import DraftProposal, VerifyResult

V = 6  # as test_verify_distribution's SETTINGS and chi-square (alpha = 1e-4, small cells pooled) assume
BOS = 0
TRIALS = 20_000
# Two levels: nodes 0-2 hang off the root, then two children under each (nodes 3-8).
PARENTS = [-1, -1, -1, 0, 0, 1, 1, 2, 2]

pytestmark = pytest.mark.usefixtures("single_thread")


def tree(tokens: list[int], parents: list[int], probs: torch.Tensor | None = None) -> DraftProposal:
    return DraftProposal(torch.tensor(tokens), torch.tensor(parents), probs)


# ---- the greedy path and the forward's inputs


def test_greedy_follows_the_targets_argmax_down_the_tree() -> None:
    # root -> {1, 2}; node 1 (token 2) -> {3, 4}; node 3 (token 4) -> {0}
    proposal = tree([1, 2, 3, 4, 0], [-1, -1, 1, 1, 3])
    logits = torch.full((6, V), -1.0)  # [N+1, V]: row 0 the root, row i+1 node i
    for row, best in {0: 2, 2: 4, 4: 0, 5: 5}.items():
        logits[row, best] = 1.0
    result = verify(proposal, logits, SamplingParams(), None)
    assert result.path == [1, 3, 4] and result.tokens == [2, 4, 0, 5] and result.kept_rows == [0, 2, 4, 5]


def test_greedy_recovers_at_the_root_when_no_child_matches() -> None:
    logits = torch.zeros(4, V)
    logits[0, 5] = 1.0
    result = verify(tree([1, 2, 3], [-1, -1, 0]), logits, SamplingParams(), None)
    assert result.path == [] and result.tokens == [5]


def test_greedy_takes_the_first_of_equal_siblings() -> None:
    logits = torch.zeros(4, V)
    logits[0, 3] = 1.0
    result = verify(tree([3, 3, 1], [-1, -1, 0]), logits, SamplingParams(), None)
    assert result.path[0] == 0


def test_inputs_place_nodes_at_root_plus_depth_and_see_only_ancestors() -> None:
    parents = [-1, -1, 0, 0, 2]
    inputs = verify_inputs(9, tree([1, 2, 3, 4, 5], parents), start=10, device=torch.device("cpu"))
    assert inputs.tokens.tolist() == [[9, 1, 2, 3, 4, 5]]
    assert inputs.positions.tolist() == [[10, 11, 11, 12, 12, 13]]
    assert depths(parents) == [1, 1, 2, 2, 3]
    expected = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0], [1, 1, 0, 1, 0, 0],
                             [1, 1, 0, 0, 1, 0], [1, 1, 0, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(inputs.mask[0], expected) and torch.equal(ancestor_mask(parents), expected)
    chain = verify_inputs(9, DraftProposal.chain([1, 2]), start=4, device=torch.device("cpu"))
    assert chain.mask is None and chain.positions.tolist() == [[4, 5, 6]]


def test_paths_merge_into_a_trie_in_topological_order() -> None:
    tokens, parents = tree_from_paths([[1, 2, 3], [1, 2, 4], [5, 6], [1, 7]])
    assert tokens == [1, 2, 3, 4, 5, 6, 7] and parents == [-1, 0, 1, 1, -1, 4, 0]
    assert children_of(parents)[0] == [0, 4]  # root: the first path's branch first


def test_parents_out_of_order_are_one_clear_error() -> None:
    with pytest.raises(SpecDecodeError, match="node 1 has parent 2"):
        check_parents([-1, 2, 0])


# ---- the law of the committed tokens


def _tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    target = 1.5 * torch.randn(3, V, V, generator=g)  # [depth, previous token, V]
    draft = target + 1.5 * torch.randn(3, V, V, generator=g)  # [depth, previous token, V]
    return target, draft


def _trial_tree(q_table: torch.Tensor, mode: str, g: torch.Generator) -> tuple[list[int], torch.Tensor | None]:
    """-> the tokens of one tree with PARENTS' shape and, when drawn, each node's q row [N, V]."""
    if mode == "drawn":  # every node drawn independently from its parent's q row
        tokens, rows = [], []
        for parent in PARENTS:
            row = q_table[0, BOS] if parent < 0 else q_table[1, tokens[parent]]  # [V]
            tokens.append(int(sample(row, g)))
            rows.append(row)
        return tokens, torch.stack(rows)
    first = q_table[0, BOS].topk(3).indices.tolist()
    if mode == "duplicates":
        first = [first[0], first[0], first[1]]  # the same token twice among siblings
    tokens = list(first)
    for child in first:
        tokens += q_table[1, child].topk(2).indices.tolist()
    return tokens, None


def _emit(step, params: SamplingParams, mode: str, trials: int = TRIALS, seed: int = 7):
    target, draft = _tables(seed)
    p_table = logits_to_probs(target, params)  # [depth, prev, V]
    q_table = logits_to_probs(draft, params)  # [depth, prev, V]
    g = torch.Generator().manual_seed(seed)
    outputs = []
    with torch.inference_mode():
        for _ in range(trials):
            tokens, probs = _trial_tree(q_table, mode, g)
            rows = [target[0, BOS]] + [target[1 if parent < 0 else 2, token]
                                       for token, parent in zip(tokens, PARENTS)]
            committed = step(tree(tokens, PARENTS, probs), torch.stack(rows), params, g).tokens  # [N+1, V] rows
            outputs.append(committed[:2] if len(committed) > 1 else [committed[0], -1])
    emitted = torch.tensor(outputs)  # [T, 2]
    later = emitted[:, 1] < 0
    emitted[later, 1] = sample(p_table[1, emitted[later, 0]], g)  # a later step's first token
    joint = p_table[0, BOS].double()[:, None] * p_table[1].double()  # [V, V] p(y1) p(y2 | y1)
    return emitted, joint


def _assert_matches(emitted: torch.Tensor, joint: torch.Tensor) -> None:
    pairs = torch.bincount(emitted[:, 0] * V + emitted[:, 1], minlength=V * V).view(V, V).double()  # [V, V]
    for name, counts, probs in [("joint", pairs.flatten(), joint.flatten()), ("y1", pairs.sum(1), joint.sum(1)),
                                ("y2", pairs.sum(0), joint.sum(0))]:
        statistic, critical = _chi_square(counts, probs)
        assert statistic < critical, f"{name}: chi-square {statistic:.1f} >= critical {critical:.1f}"


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("mode", ["drawn", "duplicates"])  # duplicates: deterministic top-k, one token twice
def test_tree_output_follows_the_target_distribution(setting: str, mode: str) -> None:
    emitted, joint = _emit(verify, SETTINGS[setting], mode)
    _assert_matches(emitted, joint)


def _sibling_mass_kept(proposal: DraftProposal, logits: torch.Tensor, params: SamplingParams, g) -> VerifyResult:
    """Wrong: each deterministic sibling is accepted with its own p(x), the rejected siblings' mass left in."""
    p = logits_to_probs(logits, params)  # [N+1, V]
    tokens, children = proposal.tokens.tolist(), children_of(proposal.parent_list())
    row, path = 0, []
    while True:
        uniforms = torch.rand(len(children[row]), generator=g).tolist()
        node = next((c for c, u in zip(children[row], uniforms) if u < float(p[row, tokens[c]])), None)
        if node is None:
            residual = p[row].clone()
            residual[[tokens[c] for c in children[row]]] = 0
            return VerifyResult(path, [tokens[i] for i in path] + [int(sample(residual, g))])
        path.append(node)
        row = node + 1


def test_the_check_rejects_a_rule_that_keeps_rejected_siblings_mass() -> None:
    emitted, joint = _emit(_sibling_mass_kept, SETTINGS["temperature"], "deterministic", trials=TRIALS // 4)
    with pytest.raises(AssertionError, match="chi-square"):
        _assert_matches(emitted, joint)

"""Token Recycling (Luo et al. 2024, "Turning Trash into Treasure", arXiv:2408.08696): draft from what the target
itself said next, at no model cost.

Every verify forward computes the target's logits at every row it was fed, the rows of rejected drafts included
(the "trash"). For each token fed, the top-k tokens of its row are what the target would say after it; they go
into an adjacency matrix M [V, k] (row t: the last successors seen after token t, best first), replaced each time
t is fed again. Drafting walks M from the last committed token: a chain follows each token's best successor; a
tree fills a static template (the `recycle_tree_nodes` likeliest nodes under a fixed prior, static_template) with
M's successors. It drafts what the target tends to say next, so it helps on text
that lookups (ngram, suffix) cannot match: free text, questions, chat.

M is kept per Engine across requests, as the paper does (its memory is reported as the drafter's cache), or, with
`recycle_shared` off (a server's default: its users may not see each other's text), per request. Drafts are
deterministic, verified against a one-hot q.

It is not a member of `auto`: on 18 unseen prompts of six kinds it ran at 0.99x plain decoding, and in `auto` it
took steps from members that pay (measured for issue #62). It is one flag away
(`--spec-type suffix,recycle,draft --combine best`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.drafters.base import Drafter, DrafterCaps, DrafterResources, NoOptions, option
from specdecode.drafters.capabilities import MemorySizing, ReadsVerifyRows
from specdecode.drafters.registry import register
from specdecode.spec_types import DraftProposal, Sequence, TargetOutput

UNSEEN = -1  # an M entry no forward has filled
# The template's prior: the target's best successor is accepted this often (a rank-r one, this / (r + 1)); it
# shapes the tree only (how deep against how wide), never the output.
TOP_ACCEPTANCE = 0.6


@dataclass(frozen=True)
class RecycleOptions(NoOptions):
    recycle_topk: int = option(8, "successors kept per token in the adjacency matrix (the paper's k)", ge=1, le=32)
    recycle_tree_nodes: int = option(0, "draft a tree of this many nodes from the static template (0 = a chain "
                                        "of each token's best successor)", ge=0, le=128)
    recycle_shared: bool = option(True, "keep the adjacency matrix across requests (off: each request starts "
                                        "empty)", serve_default=False)


@register
class RecycleDrafter(Drafter, MemorySizing, ReadsVerifyRows):
    name = "recycle"
    Options = RecycleOptions
    caps = DrafterCaps(emits_trees=True)
    tree_options = {"recycle_tree_nodes": 16}

    def __init__(self, vocab_size: int, options: RecycleOptions):
        self.vocab_size = vocab_size
        self.options = options
        self.template = static_template(options.recycle_tree_nodes, options.recycle_topk)
        self.shared = new_adjacency(vocab_size, options.recycle_topk) if options.recycle_shared else None

    @classmethod
    def create(cls, resources: DrafterResources, options: RecycleOptions) -> RecycleDrafter:
        return cls(resources.target.config.vocab_size, options)

    def _adjacency(self, seq: Sequence) -> torch.Tensor:
        return self.shared if self.shared is not None else seq.drafter_state[self.name]

    def start(self, seq: Sequence, prefill: TargetOutput) -> None:
        if self.shared is None:
            seq.drafter_state[self.name] = new_adjacency(self.vocab_size, self.options.recycle_topk)
        # The prefill's last row is the target's distribution after the prompt's last token.
        self._learn(seq, torch.tensor(seq.tokens[seq.prompt_len - 1 : seq.prompt_len]), prefill.logits[-1:])

    def observe(self, seq: Sequence, fed: torch.Tensor, target: TargetOutput) -> None:
        self._learn(seq, fed, target.logits)

    def _learn(self, seq: Sequence, fed: torch.Tensor, logits: torch.Tensor) -> None:
        """fed [T] the tokens of a forward's rows, logits [T, V] their rows -> each fed token's row of M."""
        successors = logits.topk(self.options.recycle_topk, dim=-1).indices  # [T, k]
        self._adjacency(seq)[fed.to(torch.long).cpu()] = successors.to(torch.int32).cpu()

    def propose(self, seq: Sequence, budget: int) -> DraftProposal:
        adjacency = self._adjacency(seq)
        if not self.template:
            chain, token = [], seq.tokens[-1]
            while len(chain) < budget and (token := int(adjacency[token, 0])) != UNSEEN:
                chain.append(token)
            return DraftProposal.chain(chain, source=self.name)
        return self._tree(adjacency, seq.tokens[-1], budget)

    def _tree(self, adjacency: torch.Tensor, root: int, budget: int) -> DraftProposal:
        """The template's nodes whose successor exists, at most `budget` deep (nodes in topological order)."""
        tokens, parents, kept = [], [], {}  # kept: template index -> proposal index
        for index, (parent, rank, depth) in enumerate(self.template):
            if depth > budget or (parent != -1 and parent not in kept):
                continue
            after = root if parent == -1 else tokens[kept[parent]]
            token = int(adjacency[after, rank])
            if token == UNSEEN:
                continue
            kept[index] = len(tokens)
            tokens.append(token)
            parents.append(-1 if parent == -1 else kept[parent])
        return DraftProposal(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long), None,
                             self.name)

    def max_nodes(self, budget: int) -> int:
        return max(budget, len(self.template))

    def cache_bytes(self) -> int:
        return 0 if self.shared is None else self.shared.nbytes

    def request_bytes(self, seq: Sequence) -> int:
        state = seq.drafter_state.get(self.name)
        return 0 if state is None else state.nbytes


def new_adjacency(vocab_size: int, topk: int) -> torch.Tensor:
    """M [V, k] int32, every entry UNSEEN."""
    return torch.full((vocab_size, topk), UNSEEN, dtype=torch.int32)


def static_template(nodes: int, topk: int) -> list[tuple[int, int, int]]:
    """The `nodes` likeliest nodes of a tree in which a rank-r successor is accepted with chance
    TOP_ACCEPTANCE / (r + 1) given its parent was, best first (a parent always before its children) -> (parent
    template index or -1, rank among siblings, depth) each."""
    template: list[tuple[int, int, int]] = []
    frontier = [(TOP_ACCEPTANCE / (rank + 1), -1, rank, 1) for rank in range(topk)]  # (weight, parent, rank, depth)
    while frontier and len(template) < nodes:
        best = max(range(len(frontier)), key=lambda i: (frontier[i][0], -i))
        weight, parent, rank, depth = frontier.pop(best)
        template.append((parent, rank, depth))
        index = len(template) - 1
        frontier.extend((weight * TOP_ACCEPTANCE / (child + 1), index, child, depth + 1) for child in range(topk))
    return template

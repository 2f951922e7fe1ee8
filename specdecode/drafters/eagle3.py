"""EAGLE-3: a one-layer head reads three of the target's hidden states and drafts from them (models/heads/eagle3.py).

Alignment (as the reference and vLLM): the head's row for position p pairs the target's features of token p
with the embedding of token p+1, at rope position p, and predicts token p+2. After each step the head reads the
target's features along the accepted path (the root and each accepted node), so its cache holds rows for every
committed position but the last; its output there proposes the first draft token. Later draft steps feed back
the head's own output hidden state at the next position; those rows are dropped at commit, when the target's
true features replace them.

Chains by default; with `eagle3_tree_nodes` an EAGLE-2 dynamic tree (dynamic_tree.py), one head forward per depth.
In a batched step (the server's), the chains of the requests drafting with this head share each forward, catch-up
and drafted positions alike, where the head is batch-invariant (w4a8, its attention in the fixed-order kernel:
models/batch_invariance.py); each request then drafts bit for bit what it drafts alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from specdecode.config import MAX_DRAFT_TOKENS
from specdecode.drafters.base import Drafter, DrafterCaps, DrafterResources, NoOptions, option
from specdecode.drafters.capabilities import AutoMember, Batching, MemorySizing
from specdecode.drafters.dynamic_tree import DynamicTree, tree_log_probs
from specdecode.drafters.hidden_drafting import draft_chains, read_pending
from specdecode.drafters.registry import register
from specdecode.models.batch_invariance import fix_eagle3_attention
from specdecode.models.decoder.kv_cache import CacheBatch, KVCache
from specdecode.models.heads.draft_vocab import spread_to_vocab
from specdecode.models.heads.eagle3 import Eagle3Head
from specdecode.models.loader import module_bytes
from specdecode.spec_types import DraftProposal, Sequence, TargetOutput, VerifyResult

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Eagle3Options(NoOptions):
    eagle3_tree_nodes: int = option(0, "propose an EAGLE-2 dynamic tree of at most this many nodes (0 = a chain)",
                                    ge=0, le=MAX_DRAFT_TOKENS)
    eagle3_tree_width: int = option(4, "in tree mode: nodes expanded per depth, and children per expanded node",
                                    ge=1, le=16)


@dataclass
class Eagle3State:
    """One request's head state."""

    cache: KVCache  # the head's one-layer cache: rows for positions 0..fed-1, then a proposal's rows
    fed: int  # committed positions the head has read
    pending: torch.Tensor  # [R, H] fused target features of positions fed..fed+R-1, not read yet
    logits: torch.Tensor | None = None  # [Vd] the head's output at its last committed row: the next draft
    hidden: torch.Tensor | None = None  # [H] the hidden state that row feeds back


@register
class Eagle3Drafter(Drafter, AutoMember, Batching, MemorySizing):
    name = "eagle3"
    auto_rank = 3
    weights_kind = "an EAGLE-3 head"
    caps = DrafterCaps(emits_probs=True, emits_trees=True, draft_files=True)
    Options = Eagle3Options
    aliases = ("draft-eagle3",)
    vllm_method = "eagle3"
    tree_options = {"eagle3_tree_nodes": 8, "eagle3_tree_width": 3}

    def __init__(self, head: Eagle3Head, target_vocab: int, options: Eagle3Options):
        self.head = head
        self.target_vocab = target_vocab
        self.options = options
        # A head over the full vocabulary in the target's order needs no mapping.
        self.maps_vocab = not torch.equal(head.draft_to_target.cpu(), torch.arange(target_vocab))
        self.caps = DrafterCaps(hidden_layers=head.config.layer_ids, emits_probs=True, emits_trees=True,
                                draft_files=True)
        self.batch_invariant = head.layer.fixed_attention is not None

    @classmethod
    def create(cls, resources: DrafterResources, options: Eagle3Options) -> Eagle3Drafter:
        from specdecode.models.formats.eagle3 import load_eagle3_head
        from specdecode.models.kernels.quantize_module import quantize_linears

        cls.check_resources(resources)
        path = resources.path_for("eagle3")
        target = resources.target.model
        key = f"eagle3:{path}"
        if key not in resources.own_weights:  # another configuration (chain or tree) may have loaded it
            head, description = load_eagle3_head(path, target,
                                                 resources.context_limit + MAX_DRAFT_TOKENS)
            # Its share of each step is mostly these matrix products: on CPU, --draft-quant's kernels.
            quantized = quantize_linears(head, resources.draft_quant)
            log.info("%s%s", description, f"; {quantized} layers in {resources.draft_quant}" if quantized else "")
            fix_eagle3_attention(head)  # batch-invariant where it can be: a batch's chains then share forwards
            resources.own_weights[key] = head
        return cls(resources.own_weights[key], target.config.vocab_size, options)

    @property
    def tree(self) -> bool:
        return self.options.eagle3_tree_nodes > 0

    def max_nodes(self, budget: int) -> int:
        return self.options.eagle3_tree_nodes if self.tree else budget

    def start(self, seq: Sequence, prefill: TargetOutput) -> None:
        slack = seq.draft_limit * (self.options.eagle3_tree_width if self.tree else 1)
        state = Eagle3State(self.head.new_cache(seq.capacity + slack), 0, self._features(prefill))
        seq.drafter_state[self.name] = state
        self._read_pending([seq], [state])  # the prompt now, in the prefill phase

    def propose(self, seq: Sequence, budget: int) -> DraftProposal:
        if self.tree:
            state = seq.drafter_state[self.name]
            self._read_pending([seq], [state])
            return self._tree(seq, state, budget)
        return self._chains([seq], [budget])[0]

    def propose_many(self, seqs: list[Sequence], budgets: list[int]) -> list[DraftProposal]:
        """Chains for several requests in shared forwards (one catch-up, then one per drafted position) where
        the head is batch-invariant, so each chain is what that request drafts alone; else (or trees) one by one."""
        if self.tree or not self.batch_invariant:
            return super().propose_many(seqs, budgets)
        return self.proposals_for_asked(seqs, budgets, self._chains)

    def commit(self, seq: Sequence, result: VerifyResult, target: TargetOutput) -> None:
        state = seq.drafter_state[self.name]
        state.cache.truncate(state.fed)  # a proposal's rows go; the target's features of the path come in
        state.pending = torch.cat([state.pending, self._features(target)])

    def weights_bytes(self) -> int:
        """The head's own tensors; the target's embedding (and head, when shared) are not registered in it."""
        return module_bytes(self.head)

    def request_bytes(self, seq: Sequence) -> int:
        state = seq.drafter_state.get(self.name)
        return state.cache.nbytes if state is not None else 0

    def _features(self, target: TargetOutput) -> torch.Tensor:
        """The target's rows -> fused features [T, H] (fc applied once per committed position)."""
        with torch.inference_mode():
            return self.head.fuse([target.hidden[i] for i in self.head.config.layer_ids])

    def _read_pending(self, seqs: list[Sequence], states: list[Eagle3State]) -> None:
        """Feed the head every committed position it has not read (hidden_drafting.read_pending)."""

        def forward(tokens, hidden, positions, cache, last):
            return self.head(tokens, hidden, positions, cache, logits_at=last)

        read_pending(seqs, states, [state.cache for state in states], forward, self.head.device)

    def _chains(self, seqs: list[Sequence], budgets: list[int]) -> list[DraftProposal]:
        states = [seq.drafter_state[self.name] for seq in seqs]
        self._read_pending(seqs, states)
        device = self.head.device

        def step(index: int, going: list[int], tokens: torch.Tensor, hidden: torch.Tensor):
            # [F, 1] each: one position on per step
            positions = torch.tensor([[len(seqs[b].tokens) - 2 + index] for b in going], device=device)
            caches = [states[b].cache for b in going]
            out, fed_back = self.head(tokens.view(-1, 1).to(device), hidden.unsqueeze(1), positions,
                                      caches[0] if len(caches) == 1 else CacheBatch(caches))
            return self._target_logits(out[:, -1]), fed_back[:, -1]  # [F, V], [F, H]

        return draft_chains(seqs, budgets, [self._target_logits(state.logits) for state in states],
                            [state.hidden for state in states], step, self.name)

    def _tree(self, seq: Sequence, state: Eagle3State, budget: int) -> DraftProposal:
        """Top-k children are deterministic drafts (no q): verification uses the one-hot rule, in sampling too."""
        device, width = self.head.device, self.options.eagle3_tree_width
        tree = DynamicTree(width)
        tree.add_children(-1, tree_log_probs(self._target_logits(state.logits)[None], seq.sampling), 0.0)
        fed_back = {-1: state.hidden}  # node -> the hidden its children's rows read ([H]); -1 = the root
        for depth in range(2, budget + 1):
            expand = tree.best_of_depth(depth - 1)
            inputs = torch.tensor([[tree.tokens[n] for n in expand]], device=device)  # [1, W]
            hidden = torch.stack([fed_back[tree.parents[n]] for n in expand]).unsqueeze(0)  # [1, W, H]
            # A depth-d node's row sits one position after its parent's; depth 1 right after the committed rows.
            positions = torch.full_like(inputs, len(seq.tokens) - 3 + depth)  # [1, W]
            mask = tree.feed(expand).to(device).unsqueeze(0)  # [1, W, fed + W]
            with torch.inference_mode():
                out, back = self.head(inputs, hidden, positions, state.cache, attn_mask=mask)
            log_probs = tree_log_probs(self._target_logits(out[0]), seq.sampling)  # [W, V]
            for row, node in enumerate(expand):
                fed_back[node] = back[0, row]
                tree.add_children(node, log_probs[row : row + 1], tree.scores[node])
        tokens, parents = tree.select(self.options.eagle3_tree_nodes)
        return DraftProposal(torch.tensor(tokens), torch.tensor(parents), None, self.name)

    def _target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., Vd] -> [..., V] (sampling.spread_to_vocab)."""
        return spread_to_vocab(logits, self.head.draft_to_target, self.target_vocab) if self.maps_vocab else logits

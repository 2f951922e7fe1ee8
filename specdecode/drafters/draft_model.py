"""A smaller model with the same vocabulary drafts autoregressively; its own cache follows the accepted tokens.

Chains by default; with `draft_tree_nodes` it proposes an EAGLE-2 dynamic tree instead: each depth expands the
`draft_tree_width` best nodes so far (by cumulative draft log-probability) into their top children, in one
draft forward per depth, and the best `draft_tree_nodes` nodes of all depths are verified together.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from specdecode.config import MAX_DRAFT_TOKENS
from specdecode.drafters.base import Drafter, DrafterCaps, DrafterResources, option
from specdecode.drafters.dynamic_tree import DynamicTree, tree_log_probs
from specdecode.drafters.registry import register
from specdecode.errors import SpecDecodeError
from specdecode.models.kv_cache import KVCache
from specdecode.models.loader import LoadedModel
from specdecode.sampling import logits_to_probs, sample
from specdecode.spec_types import DraftProposal, Sequence, TargetOutput, VerifyResult

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftModelOptions:
    draft_p_min: float = option(0.0, "stop drafting a chain when the draft's top probability is below this "
                                "(0 = off)", llama_cpp="--draft-p-min")
    draft_tree_nodes: int = option(0, "propose an EAGLE-2 dynamic tree of at most this many nodes (0 = a chain)")
    draft_tree_width: int = option(4, "in tree mode: nodes expanded per depth, and children per expanded node")

    def check(self) -> None:
        if not 0 <= self.draft_p_min < 1:
            raise SpecDecodeError(f"draft_p_min must be in [0, 1), got {self.draft_p_min}")
        if not 0 <= self.draft_tree_nodes <= MAX_DRAFT_TOKENS:
            raise SpecDecodeError(f"draft_tree_nodes must be between 0 and {MAX_DRAFT_TOKENS}, "
                                  f"got {self.draft_tree_nodes}")
        if not 1 <= self.draft_tree_width <= 16:
            raise SpecDecodeError(f"draft_tree_width must be between 1 and 16, got {self.draft_tree_width}")


@register
class DraftModelDrafter(Drafter):
    name = "draft"
    caps = DrafterCaps(emits_probs=True, emits_trees=True, needs_draft_model=True)
    Options = DraftModelOptions
    vllm_method = "draft_model"
    tree_options = {"draft_tree_nodes": 8, "draft_tree_width": 3}

    def __init__(self, draft: LoadedModel, target_vocab: int, options: DraftModelOptions):
        self.draft = draft
        self.target_vocab = target_vocab
        self.options = options

    @classmethod
    def create(cls, resources: DrafterResources, options: DraftModelOptions) -> DraftModelDrafter:
        if resources.draft is None:
            raise SpecDecodeError("method 'draft' needs a draft model (--draft-model NAME_OR_PATH)")
        check_vocabularies(resources.target, resources.draft)
        return cls(resources.draft, resources.target.config.vocab_size, options)

    @property
    def tree(self) -> bool:
        return self.options.draft_tree_nodes > 0

    def max_nodes(self, budget: int) -> int:
        return self.options.draft_tree_nodes if self.tree else budget

    def start(self, seq: Sequence, prefill: TargetOutput) -> None:
        # Room for the committed tokens plus what one proposal feeds beyond them (a chain, or a tree's levels).
        slack = seq.draft_length.maximum * (self.options.draft_tree_width if self.tree else 1)
        cache = self.draft.model.new_cache(seq.capacity + slack)
        seq.drafter_state[self.name] = cache
        # The prompt now, in the prefill phase; the first generated token comes with the first proposal.
        self._feed(seq, cache, logits_at=slice(0, 0), upto=seq.prompt_len)

    def propose(self, seq: Sequence, budget: int) -> DraftProposal:
        cache = seq.drafter_state[self.name]
        logits = self._catch_up(seq, cache)  # [V]
        return self._tree(seq, cache, logits, budget) if self.tree else self._chain(seq, cache, logits, budget)

    def request_bytes(self, seq: Sequence) -> int:
        cache = seq.drafter_state.get(self.name)
        return cache.nbytes if cache is not None else 0

    def commit(self, seq: Sequence, result: VerifyResult, target: TargetOutput) -> None:
        # Keep only cached tokens that were accepted; everything after them is overwritten next time.
        cache = seq.drafter_state[self.name]
        cache.truncate(min(cache.lengths[0], len(seq.tokens) - 1))

    def _chain(self, seq: Sequence, cache: KVCache, logits: torch.Tensor, budget: int) -> DraftProposal:
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        model = self.draft.model
        p_min = self.options.draft_p_min
        for i in range(budget):
            if seq.sampling.greedy:
                token = int(logits.argmax())
                confidence = torch.softmax(logits, dim=-1)[token] if p_min else None
            else:
                q = logits_to_probs(logits, seq.sampling)  # [V]: the law the draft token is drawn from
                token = int(sample(q, seq.generator))
                confidence = q.max() if p_min else None
                rows.append(q)
            # llama.cpp's --draft-p-min: an unsure draft is likely rejected, so stop spending time on it.
            if confidence is not None and confidence < p_min:
                rows = rows[: len(tokens)]
                break
            tokens.append(token)
            if i + 1 < budget:
                step = torch.tensor([[token]], device=model.device)  # [1, 1]
                position = torch.tensor([[len(seq.tokens) + i]], device=model.device)  # [1, 1]
                logits = self._to_target_vocab(model(step, position, cache).logits[0, -1])  # [V]
        # Greedy drafts are deterministic: verification must not see a q for them (it would bias sampling).
        probs = torch.stack(rows) if rows else None  # [K, V]
        return DraftProposal.chain(tokens, probs, self.name)

    def _tree(self, seq: Sequence, cache: KVCache, logits: torch.Tensor, budget: int) -> DraftProposal:
        """Top-k children are deterministic drafts (no q): verification uses the one-hot rule, in sampling too."""
        model, width = self.draft.model, self.options.draft_tree_width
        prefix = cache.lengths[0]  # every committed token; the tree's levels go after it and are dropped after
        tree = DynamicTree(width)
        tree.add_children(-1, tree_log_probs(logits[None], seq.sampling), 0.0)
        for depth in range(2, budget + 1):
            expand = tree.best_of_depth(depth - 1)
            inputs = torch.tensor([[tree.tokens[n] for n in expand]], device=model.device)  # [1, W]
            positions = torch.full_like(inputs, len(seq.tokens) - 2 + depth)  # [1, W]: depth d-1 sits at root + d-1
            mask = tree.feed(expand).to(model.device).unsqueeze(0)  # [1, W, fed + W]
            out = model(inputs, positions, cache, attn_mask=mask).logits[0]  # [W, V_draft]
            log_probs = tree_log_probs(self._to_target_vocab(out), seq.sampling)  # [W, V]
            for row, node in enumerate(expand):
                tree.add_children(node, log_probs[row : row + 1], tree.scores[node])
        cache.truncate(prefix)
        tokens, parents = tree.select(self.options.draft_tree_nodes)
        return DraftProposal(torch.tensor(tokens), torch.tensor(parents), None, self.name)

    def _catch_up(self, seq: Sequence, cache: KVCache) -> torch.Tensor:
        """Feed every committed token not yet in the draft cache in one forward; -> next-token logits [V].

        That is the target's corrected or bonus token, the accepted path of a tree, or a stretch that another
        drafter of a chain won.
        """
        return self._to_target_vocab(self._feed(seq, cache, slice(-1, None), len(seq.tokens))[0, -1])

    def _feed(self, seq: Sequence, cache: KVCache, logits_at: slice, upto: int) -> torch.Tensor:
        model, seen = self.draft.model, cache.lengths[0]
        pending = torch.tensor([seq.tokens[seen:upto]], device=model.device)  # [1, P]
        positions = torch.arange(seen, upto, device=model.device).unsqueeze(0)  # [1, P]
        return model(pending, positions, cache, logits_at=logits_at).logits  # [1, P', V_draft]

    def _to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [..., V_draft] -> [..., V_target]: padded embedding rows differ between sizes of one family.

        Ids the target does not have get -inf, so they are never drafted and q stays the law drafts follow.
        """
        size = logits.shape[-1]
        if size >= self.target_vocab:
            return logits[..., : self.target_vocab]
        return torch.nn.functional.pad(logits, (0, self.target_vocab - size), value=float("-inf"))


def check_vocabularies(target: LoadedModel, draft: LoadedModel) -> None:
    """Same token strings for the same ids, or one clear error naming both models."""
    target_tokens, draft_tokens = target.tokenizer.token_strings(), draft.tokenizer.token_strings()
    if target_tokens != draft_tokens:
        shared = min(len(target_tokens), len(draft_tokens))
        first = next((i for i in range(shared) if target_tokens[i] != draft_tokens[i]), shared)
        raise SpecDecodeError(
            f"vocabulary mismatch: draft model {draft.name!r} ({len(draft_tokens)} tokens) and target "
            f"{target.name!r} ({len(target_tokens)} tokens) differ first at id {first}; "
            "a draft model must share the target's tokenizer"
        )
    target_params, draft_params = target.config.parameter_count, draft.config.parameter_count
    if draft_params >= target_params:
        log.warning("draft model %s (%.2fB parameters) is not smaller than the target %s (%.2fB): "
                    "drafting will likely slow generation down", draft.name, draft_params / 1e9,
                    target.name, target_params / 1e9)

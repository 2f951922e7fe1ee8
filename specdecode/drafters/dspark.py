"""DSpark: DFlash's block drafting (drafters/dflash.py) with DeepSpec's slot convention, a Markov head and a
confidence cut (models/heads/dspark.py).

The drafter's context is DFlash's: the target's states of every committed position but the last, as keys and
values in every draft layer. A proposal is one backbone forward of [last committed token, MASK x (B-1)] at the
next B positions; every slot drafts (slot k the token after position root+k), one after another because slot
k's Markov correction reads slot k-1's draft, each sampled from its own corrected law. Before slot k drafts, its
confidence (read from its backbone output and the token before it, not from its own draft) is compared with
`--dspark-confidence`: below it, the block stops there. That cut is a stopping rule, so the output is exactly
plain decoding's either way; it only decides how many rows the target verifies, which on a CPU is the cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.acceptance.sampling import draw_drafts, logits_to_probs
from specdecode.config import MAX_DRAFT_TOKENS
from specdecode.drafters.base import DrafterCaps, DrafterResources, NoOptions, option
from specdecode.drafters.dflash import DFlashDrafter, shared_weights
from specdecode.drafters.registry import register
from specdecode.models.heads.dspark import DSparkModel
from specdecode.spec_types import DraftProposal, Sequence

DEFAULT_CONFIDENCE = 0.3  # measured on the default target (docs/benchmarks/README.md, DSpark section)


@dataclass(frozen=True)
class DSparkOptions(NoOptions):
    dspark_block_size: int = option(0, "slots per block, each drafting a token (0 = the drafter's own): fewer "
                                    "rows to verify per step, at the cost of shorter drafts", ge=0, le=MAX_DRAFT_TOKENS)
    dspark_confidence: float = option(DEFAULT_CONFIDENCE, "stop a block at the first slot whose confidence of "
                                      "being accepted is below this (0 = verify whole blocks; needs a drafter "
                                      "with a confidence head); never changes the output", ge=0, lt=1)


@register
class DSparkDrafter(DFlashDrafter):
    name = "dspark"
    auto_rank = 5
    weights_kind = "a DSpark drafter"
    caps = DrafterCaps(emits_probs=True, block_size=8, draft_files=True)
    Options = DSparkOptions
    aliases = ("draft-dspark",)
    vllm_method = "dspark"

    def __init__(self, model: DSparkModel, options: DSparkOptions):
        self.model = model
        self.block = min(options.dspark_block_size or model.config.block_size, model.config.block_size)
        self.threshold = options.dspark_confidence if model.confidence_head is not None else 0.0
        self.forward_size = model.config.block_size  # the backbone always runs the block it was trained on
        # Every slot drafts, so the target verifies the root and `block` drafts: caps.block_size counts the root.
        self.caps = DrafterCaps(hidden_layers=tuple(sorted(model.config.boundary_ids)), emits_probs=True,
                                block_size=self.block + 1, draft_files=True)

    @classmethod
    def create(cls, resources: DrafterResources, options: DSparkOptions) -> DSparkDrafter:
        from specdecode.models.formats.dspark import load_dspark

        cls.check_resources(resources)
        return cls(shared_weights(resources, "dspark", load_dspark), options)

    def max_nodes(self, budget: int) -> int:
        return min(budget, self.block)

    def _drafting_rows(self, seq: Sequence, budget: int, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, H] one block -> the slots that may draft, [n, H] (every slot drafts in DeepSpec's convention),
        none when slot 0 is already doubtful: the cut comes before the head, most of the cost."""
        slots = self.max_nodes(budget)
        with torch.inference_mode():
            doubtful = bool(self.threshold) and self._doubtful(hidden[:1], self._root(seq))
        if doubtful:
            seq.note("dspark_confidence_cut", slots)
            return hidden[:0]
        return hidden[:slots]

    def _draft(self, seq: Sequence, hidden: torch.Tensor, base: torch.Tensor) -> DraftProposal:
        """The slots' hidden [n, H] and head logits [n, V] -> drafts one slot after another (slot k's Markov
        correction reads slot k-1's draft), each from its own corrected law, until a slot is doubtful."""
        slots = hidden.shape[0]
        drafts: list[int] = []
        laws: list[torch.Tensor] = []  # [1, V] each: the law each draft was drawn from (none when coupled)
        previous = self._root(seq)  # [1]
        with torch.inference_mode():
            markov = self.model.start_state(1)  # [1, r]
            for slot in range(slots):
                if slot and self.threshold and self._doubtful(hidden[slot : slot + 1], previous):
                    seq.note("dspark_confidence_cut", slots - slot)
                    break
                logits, markov = self.model.slot_logits(base[slot : slot + 1], hidden[slot : slot + 1], previous,
                                                        markov)
                if seq.sampling.greedy:
                    previous = logits.argmax(dim=-1)  # [1]
                else:
                    q = logits_to_probs(logits, seq.sampling)  # [1, V]
                    previous, law = draw_drafts(q, seq, len(seq.tokens) + slot)  # [1], [1, V] or None
                    if law is not None:
                        laws.append(law)
                drafts.append(int(previous))
        return DraftProposal.chain(drafts, torch.cat(laws) if laws else None, self.name)

    def _root(self, seq: Sequence) -> torch.Tensor:
        """[1] the last committed token: what slot 0's Markov correction and confidence read as the token before."""
        return torch.tensor([seq.tokens[-1]], device=self.model.device)

    def _doubtful(self, hidden: torch.Tensor, previous: torch.Tensor) -> bool:
        """Whether the slot's estimated chance of acceptance (hidden [1, H], previous [1]) is below the threshold."""
        return bool(torch.sigmoid(self.model.confidence_logits(hidden, previous)) < self.threshold)

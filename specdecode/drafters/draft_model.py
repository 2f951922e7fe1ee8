"""A smaller model with the same vocabulary drafts autoregressively; its own cache follows the accepted tokens."""

from __future__ import annotations

import logging

import torch

from specdecode.drafters.base import DraftProposal, Drafter, DrafterContext, SequenceState, register
from specdecode.errors import SpecDecodeError
from specdecode.models.kv_cache import KVCache
from specdecode.models.loader import LoadedModel
from specdecode.sampling import logits_to_probs, sample

log = logging.getLogger(__name__)


@register
class DraftModelDrafter(Drafter):
    name = "draft"
    needs_draft_model = True

    def __init__(self, draft: LoadedModel, target_vocab: int, p_min: float = 0.0):
        self.draft = draft
        self.target_vocab = target_vocab
        self.p_min = p_min
        self.cache: KVCache | None = None

    @classmethod
    def create(cls, context: DrafterContext) -> DraftModelDrafter:
        if context.draft is None:
            raise SpecDecodeError("method 'draft' needs a draft model (--draft-model NAME_OR_PATH)")
        return cls(context.draft, context.target.config.vocab_size, context.spec.draft_p_min)

    def begin(self, seq: SequenceState) -> None:
        self.cache = self.draft.model.new_cache(seq.capacity)

    def propose(self, seq: SequenceState, k: int) -> DraftProposal:
        logits = self._catch_up(seq)  # [V]
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        model = self.draft.model
        for i in range(k):
            if seq.sampling.greedy:
                token = int(logits.argmax())
                confidence = torch.softmax(logits, dim=-1)[token] if self.p_min else None
            else:
                q = logits_to_probs(logits, seq.sampling)  # [V]: the law the draft token is drawn from
                token = int(sample(q, seq.generator))
                confidence = q.max() if self.p_min else None
                rows.append(q)
            # llama.cpp's --draft-p-min: an unsure draft is likely rejected, so stop spending time on it.
            if confidence is not None and confidence < self.p_min:
                rows = rows[: len(tokens)]
                break
            tokens.append(token)
            if i + 1 < k:
                step = torch.tensor([[token]], device=model.device)  # [1, 1]
                position = torch.tensor([[len(seq.tokens) + i]], device=model.device)  # [1, 1]
                logits = self._to_target_vocab(model(step, position, self.cache).logits[0, -1])  # [V]
        if not tokens:
            return DraftProposal.empty(self.name)
        # Greedy drafts are deterministic: verification must not see a q for them (it would bias sampling).
        probs = torch.stack(rows) if rows else None  # [K, V]
        return DraftProposal(tokens, probs, self.name)

    def _catch_up(self, seq: SequenceState) -> torch.Tensor:
        """Feed every committed token not yet in the draft cache in one forward; -> next-token logits [V].

        That is the prompt on the first step, the target's corrected or bonus token, or a stretch that another
        drafter of a chain won.
        """
        model, seen = self.draft.model, self.cache.lengths[0]
        pending = torch.tensor([seq.tokens[seen:]], device=model.device)  # [1, P]
        positions = torch.arange(seen, len(seq.tokens), device=model.device).unsqueeze(0)  # [1, P]
        logits = model(pending, positions, self.cache, logits_at=slice(-1, None)).logits[0, -1]  # [V_draft]
        return self._to_target_vocab(logits)

    def commit(self, seq: SequenceState, result) -> None:
        # Keep only cached tokens that were accepted; everything after them is overwritten next time.
        self.cache.truncate(min(self.cache.lengths[0], len(seq.tokens) - 1))

    def _to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V_draft] -> [V_target]: padded embedding rows differ between sizes of one family.

        Ids the target does not have get -inf, so they are never drafted and q stays the law drafts follow.
        """
        size = logits.shape[0]
        if size >= self.target_vocab:
            return logits[: self.target_vocab]
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
    target_params = sum(p.numel() for p in target.model.parameters())
    draft_params = sum(p.numel() for p in draft.model.parameters())
    if draft_params >= target_params:
        log.warning("draft model %s (%.2fB parameters) is not smaller than the target %s (%.2fB): "
                    "drafting will likely slow generation down", draft.name, draft_params / 1e9,
                    target.name, target_params / 1e9)

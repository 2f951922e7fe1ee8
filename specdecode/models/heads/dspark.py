"""The DSpark drafter (DeepSeek's DeepSpec, arXiv 2607.05147): a DFlash backbone (dflash.py) that drafts
with every slot of its block, a low-rank Markov head that corrects each slot by the token drafted before it, and a
confidence head that estimates, slot by slot, whether verification will accept the draft.

As DeepSpec computes it (deepspec/modeling/dspark, eval/dspark/draft_ops.py):

    Hb    = backbone([x_root, MASK, ..., MASK])            [B, H] after the output norm; slot k predicts root+k+1
    U_k   = head(Hb_k)                                     the target's head
    e_k   = W1[prev_k]                                     prev_0 = x_root, prev_k = the draft of slot k-1
    vanilla: z_k = U_k + W2(e_k)
    gated:   z_k = U_k + W2(sigmoid(gate([Hb_k ; e_k])) * e_k)
    rnn:     g, c, o = joint([s ; e_k ; Hb_k]); s = sigmoid(g) s + (1 - sigmoid(g)) tanh(c); z_k = U_k + W2(tanh(o))
    conf_k = sigmoid(proj([Hb_k ; e_k]))                   ([Hb_k] alone without `confidence_head_with_markov`)

Slot k's law depends on the drafts before it (through prev_k), as a draft model's does, so a chain of DSpark
drafts verifies with the usual rule. conf_k reads only what precedes slot k's draft, so cutting the block at the
first slot below a threshold is a stopping rule and leaves the output exactly as it was.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specdecode.models.heads.dflash import DFlashConfig, DFlashModel

MARKOV_KINDS = ("vanilla", "gated", "rnn")


@dataclass(frozen=True)
class DSparkHeads:
    markov_rank: int = 256  # 0: no Markov head (DeepSpec's own DFlash baseline, with DSpark's slot convention)
    markov_kind: str = "vanilla"  # vanilla, gated or rnn
    confidence: bool = True  # a confidence head is present
    confidence_with_markov: bool = True  # it reads the previous token's Markov embedding too


class MarkovHead(nn.Module):
    """The low-rank correction of a slot's logits by the previous token (names as DeepSpec stores them)."""

    def __init__(self, vocab: int, hidden: int, heads: DSparkHeads, outputs: int | None = None):
        """outputs: the rows of W2, the draft vocabulary's size when it is smaller than the target's `vocab`
        (speculators' reduced vocabularies; W1 is indexed by target ids either way)."""
        super().__init__()
        rank = heads.markov_rank
        self.kind, self.rank = heads.markov_kind, rank
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, outputs or vocab, bias=False)
        self.draft_to_target: torch.Tensor | None = None  # [Vd] long: the target id of each W2 row, when reduced
        if self.kind == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def latents(self, embedded: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """embedded [N, S, r] the previous tokens' W1 rows, hidden [N, S, H] the slots' backbone outputs, state
        [N, r] the rnn's before the first of the S slots -> (latents [N, S, r] that W2 projects, the state after
        the last slot). Only the rnn kind runs slot after slot."""
        if self.kind == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([hidden, embedded], dim=-1))) * embedded, state
        if self.kind != "rnn":
            return embedded, state
        latents = []
        for slot in range(embedded.shape[1]):
            joint = self.joint_proj(torch.cat([state, embedded[:, slot], hidden[:, slot]], dim=-1))  # [N, 3r]
            gate, candidate, output = joint.chunk(3, dim=-1)
            gate = torch.sigmoid(gate)
            state = gate * state + (1 - gate) * torch.tanh(candidate)
            latents.append(torch.tanh(output))
        return torch.stack(latents, dim=1), state

    def corrected(self, base: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """base [..., V] the slots' logits, latents [..., r] -> [..., V] float32 with W2's correction added (only
        to a reduced draft vocabulary's tokens: the others stay at the head's -inf)."""
        bias = self.markov_w2(latents).float()  # [..., V or Vd]
        if self.draft_to_target is None:
            return base + bias
        return base.index_add(-1, self.draft_to_target, bias)


class ConfidenceHead(nn.Module):
    def __init__(self, features: int):
        super().__init__()
        self.proj = nn.Linear(features, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features [N, F] -> logits [N] float32 of the chance that the slot's draft is accepted."""
        return self.proj(features).squeeze(-1).float()


class DSparkModel(DFlashModel):
    def __init__(self, config: DFlashConfig, heads: DSparkHeads, target_embed: nn.Embedding, target_head: nn.Module,
                 draft_vocab: int | None = None):
        """draft_vocab: the size of a reduced draft vocabulary the Markov head projects onto (then call
        use_draft_vocabulary once the weights are in); None: the target's."""
        super().__init__(config, target_embed, target_head)
        self.heads = heads
        vocab, hidden = config.layer.vocab_size, config.layer.hidden_size
        self.markov_head = MarkovHead(vocab, hidden, heads, draft_vocab) if heads.markov_rank else None
        with_markov = heads.confidence_with_markov and self.markov_head is not None
        self.confidence_head = ConfidenceHead(hidden + (heads.markov_rank if with_markov else 0)) \
            if heads.confidence else None

    def use_draft_vocabulary(self, ids: torch.Tensor, head: nn.Linear) -> None:
        super().use_draft_vocabulary(ids, head)
        if self.markov_head is not None:
            self.markov_head.draft_to_target = ids.to(self.device)

    def start_state(self, rows: int) -> torch.Tensor:
        """[N, r] the Markov head's state before slot 0 (only the rnn kind uses it)."""
        return torch.zeros(rows, self.heads.markov_rank, dtype=self.dtype, device=self.device)

    def slot_logits(self, base: torch.Tensor, hidden: torch.Tensor, previous: torch.Tensor, state: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafting, one slot: base [N, V] the head's logits, hidden [N, H] the slot's backbone output, previous
        [N] the token before it -> (logits [N, V] float32 with the Markov correction, the Markov state after it)."""
        if self.markov_head is None:
            return base, state
        embedded = self.markov_head.markov_w1(previous).to(hidden.dtype)  # [N, r]
        latents, state = self.markov_head.latents(embedded[:, None], hidden[:, None], state)  # [N, 1, r]
        return self.markov_head.corrected(base, latents[:, 0]), state

    def forced_logits(self, base: torch.Tensor, hidden: torch.Tensor, previous: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Training, every slot at once with the tokens before them given (teacher forcing): base [A, B, V],
        hidden [A, B, H], previous [A, B] -> (logits [A, B, V] float32, confidence logits [A, B] or None). One
        embedding lookup and one W2 projection for all slots: what drafting slot by slot computes."""
        if self.markov_head is None:
            confidence = self.confidence_head(hidden) if self.confidence_head is not None else None
            return base, confidence
        embedded = self.markov_head.markov_w1(previous).to(hidden.dtype)  # [A, B, r]
        latents, _ = self.markov_head.latents(embedded, hidden, self.start_state(hidden.shape[0]))
        confidence = None
        if self.confidence_head is not None:
            features = torch.cat([hidden, embedded], dim=-1) if self.heads.confidence_with_markov else hidden
            confidence = self.confidence_head(features)  # [A, B]
        return self.markov_head.corrected(base, latents), confidence

    def confidence_logits(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, H], previous [N] -> [N] float32 logits of acceptance, or None without a confidence head."""
        if self.confidence_head is None:
            return None
        if self.heads.confidence_with_markov and self.markov_head is not None:
            hidden = torch.cat([hidden, self.markov_head.markov_w1(previous).to(hidden.dtype)], dim=-1)
        return self.confidence_head(hidden)

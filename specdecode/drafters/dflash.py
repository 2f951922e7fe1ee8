"""DFlash: a block-diffusion drafter proposes a whole block in one forward (models/heads/dflash.py).

As the reference's loop (PyPI `dflash`, dflash_generate): the drafter's cache holds context keys and values for
every committed position but the last, made from the target's states there; a proposal is one forward of the
block [last committed token, MASK x (B-1)] at the next B positions, whose slots 1..B-1 are the drafts (sampled
each from its own slot's law: a slot does not see the others' samples, so that law is the one verification
needs). The block's own keys never stay in the cache. After verification the target's states along the
accepted path (the root and the accepted drafts) become context. The draft length is the block (B-1 tokens,
`--dflash-block-size` to verify fewer rows), cut by the token budget, not the adaptive length.

Where the drafter is batch-invariant (every matmul w4a8, attention in the fixed-order kernel:
models/batch_invariance.py), the requests of a batched step (the server's) share one backbone forward and one
head forward, and each drafts bit for bit what it drafts alone; elsewhere they propose one at a time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from specdecode.acceptance.sampling import draw_drafts, logits_to_probs
from specdecode.config import MAX_DRAFT_TOKENS
from specdecode.drafters.base import Drafter, DrafterCaps, DrafterResources, option
from specdecode.drafters.capabilities import AutoMember, Batching, MemorySizing
from specdecode.drafters.registry import register
from specdecode.errors import SpecDecodeError
from specdecode.models.batch_invariance import fix_dflash_attention
from specdecode.models.decoder.kv_cache import KVCache
from specdecode.models.heads.dflash import DFlashModel
from specdecode.models.loader import module_bytes
from specdecode.spec_types import DraftProposal, Sequence, TargetOutput, VerifyResult

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DFlashOptions:
    dflash_block_size: int = option(0, "slots per block, the root included (0 = the drafter's own, usually 16): "
                                    "fewer rows to verify per step, at the cost of shorter drafts", ge=0,
                                    le=MAX_DRAFT_TOKENS + 1)

    def check(self) -> None:
        if self.dflash_block_size == 1:  # a block of the root alone drafts nothing
            raise SpecDecodeError(f"dflash_block_size must be 0 (the drafter's own) or 2..{MAX_DRAFT_TOKENS + 1}, "
                                  f"got {self.dflash_block_size}")


def shared_weights(resources: DrafterResources, method: str, load) -> DFlashModel:
    """The block drafter in the folder given for `method`, loaded by `load(path, target, positions)` once per
    Engine (configurations that differ only in options, such as the block size, share it) and quantized as the
    drafter's weights are asked to be."""
    from specdecode.models.kernels.quantize_module import quantize_linears

    path = resources.path_for(method)
    key = f"{method}:{path}"
    if key not in resources.own_weights:
        model, description = load(path, resources.target.model, resources.context_limit + MAX_DRAFT_TOKENS + 2)
        quantized = quantize_linears(model, resources.draft_quant)
        shared = fix_dflash_attention(model)
        log.info("%s%s%s", description, f"; {quantized} layers in {resources.draft_quant}" if quantized else "",
                 "; batch-invariant (a batch's requests share its forwards)" if shared else "")
        resources.own_weights[key] = model
    return resources.own_weights[key]


@dataclass
class DFlashState:
    cache: KVCache  # context keys and values of positions 0..fed-1 in every draft layer, then room for a block
    fed: int  # committed positions the drafter has as context
    pending: torch.Tensor  # [R, n_aux * Ht] the target's states of positions fed..fed+R-1, not in the cache yet


@register
class DFlashDrafter(Drafter, AutoMember, Batching, MemorySizing):
    name = "dflash"
    auto_rank = 4
    weights_kind = "a DFlash drafter"
    caps = DrafterCaps(emits_probs=True, block_size=16, draft_files=True)
    Options = DFlashOptions
    aliases = ("draft-dflash",)
    vllm_method = "dflash"

    def __init__(self, model: DFlashModel, options: DFlashOptions):
        self.model = model
        self.block = options.dflash_block_size or model.config.block_size
        self.forward_size = self.block  # slots the backbone runs per proposal
        self.caps = DrafterCaps(hidden_layers=tuple(sorted(model.config.boundary_ids)), emits_probs=True,
                                block_size=self.block, draft_files=True)

    @classmethod
    def create(cls, resources: DrafterResources, options: DFlashOptions) -> DFlashDrafter:
        from specdecode.models.formats.dflash import load_dflash

        cls.check_resources(resources)
        return cls(shared_weights(resources, "dflash", load_dflash), options)

    def max_nodes(self, budget: int) -> int:
        return min(budget, self.block - 1)

    def start(self, seq: Sequence, prefill: TargetOutput) -> None:
        # The fixed-order attention writes a block's keys after the context (and leaves them out of it): room.
        cache = self.model.new_cache(seq.capacity + self.model.config.block_size)
        state = DFlashState(cache, 0, self._states(prefill))
        seq.drafter_state[self.name] = state
        self._read_pending(state)  # the prompt now, in the prefill phase

    def propose(self, seq: Sequence, budget: int) -> DraftProposal:
        return self._blocks([seq], [budget])[0]

    def propose_many(self, seqs: list[Sequence], budgets: list[int]) -> list[DraftProposal]:
        if self.model.fixed_attend is None:
            return super().propose_many(seqs, budgets)
        return self.proposals_for_asked(seqs, budgets, self._blocks)

    def _blocks(self, seqs: list[Sequence], budgets: list[int]) -> list[DraftProposal]:
        """Each sequence's proposal, from one backbone forward and one head forward over all of them."""
        hidden = self._block_hidden(seqs)  # [N, B, H]
        rows = [self._drafting_rows(seq, budget, hidden[n]) for n, (seq, budget) in enumerate(zip(seqs, budgets))]
        sizes = [part.shape[0] for part in rows]
        if not sum(sizes):
            return [DraftProposal.empty(self.name) for _ in seqs]
        with torch.inference_mode():
            logits = self.model.head_logits(torch.cat(rows)).split(sizes)  # [n_b, V] each
        return [self._draft(seq, part, own) if part.shape[0] else DraftProposal.empty(self.name)
                for seq, part, own in zip(seqs, rows, logits)]

    def _block_hidden(self, seqs: list[Sequence]) -> torch.Tensor:
        """Each sequence's block [last committed token, MASK...] at its next positions over its context ->
        [N, B, H]: in one forward where the drafter is batch-invariant, else (one sequence) as PyTorch runs it."""
        for seq in seqs:
            self._read_pending(seq.drafter_state[self.name])
        device, size = self.model.device, self.forward_size
        tokens = torch.full((len(seqs), size), self.model.config.mask_token_id, dtype=torch.long)  # [N, B]
        tokens[:, 0] = torch.tensor([seq.tokens[-1] for seq in seqs])
        roots = torch.tensor([len(seq.tokens) - 1 for seq in seqs])  # [N]: each block's slot 0
        positions = roots[:, None] + torch.arange(size)  # [N, B]
        tokens, positions = tokens.to(device), positions.to(device)
        caches = [seq.drafter_state[self.name].cache for seq in seqs]
        with torch.inference_mode():
            if self.model.fixed_attend is not None:
                return self.model.blocks_hidden(tokens, positions, caches)
            return torch.stack([self.model.block_hidden(tokens[n], positions[n], cache)
                                for n, cache in enumerate(caches)])

    def _drafting_rows(self, seq: Sequence, budget: int, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, H] one block -> the rows whose logits draft, [n, H]: slots 1..n in z-lab's convention."""
        return hidden[1 : 1 + self.max_nodes(budget)]

    def _draft(self, seq: Sequence, hidden: torch.Tensor, logits: torch.Tensor) -> DraftProposal:
        """The drafting rows' hidden [n, H] and logits [n, V] -> the proposal, each slot drawn from its own law (slot k
        for the position after the root's + k)."""
        if seq.sampling.greedy:
            return DraftProposal.chain(logits.argmax(dim=-1).tolist(), None, self.name)
        q = logits_to_probs(logits, seq.sampling)  # [n, V]: each slot's own law
        tokens, laws = draw_drafts(q, seq, len(seq.tokens))  # [n], [n, V] or None (coupled)
        return DraftProposal.chain(tokens.tolist(), laws, self.name)

    def commit(self, seq: Sequence, result: VerifyResult, target: TargetOutput) -> None:
        state = seq.drafter_state[self.name]
        state.pending = torch.cat([state.pending, self._states(target)])

    def weights_bytes(self) -> int:
        return module_bytes(self.model)

    def request_bytes(self, seq: Sequence) -> int:
        state = seq.drafter_state.get(self.name)
        return state.cache.nbytes if state is not None else 0

    def _states(self, target: TargetOutput) -> torch.Tensor:
        """The target's rows -> [T, n_aux * Ht], the states in the order of the drafter's config (fc's blocks)."""
        return torch.cat([target.hidden[i] for i in self.model.config.boundary_ids], dim=-1)

    def _read_pending(self, state: DFlashState) -> None:
        rows = state.pending.shape[0]
        if rows == 0:
            return
        positions = torch.arange(state.fed, state.fed + rows, device=self.model.device)  # [R]
        with torch.inference_mode():
            self.model.add_context(state.pending, positions, state.cache)
        state.fed += rows
        state.pending = state.pending[:0]

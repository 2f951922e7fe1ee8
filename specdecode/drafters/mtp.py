"""MTP: draft with the multi-token-prediction modules the target ships (models/decoder/mtp.py); no second model.

Alignment (as vLLM's MTP proposer, and EAGLE-3's, eagle3.py): module 0's row for position p pairs the target's
final hidden state of token p with the embedding of token p+1, at rope position p, and predicts token p+2.
After each step module 0 reads the target's rows along the accepted path, so its cache holds every committed
position but the last, and its output there is the first draft token. Draft token i+1 comes from module
min(i, n-1) fed the previous step's hidden state and draft token, one position on: with one module (what
DeepSeek-V3, GLM-4.5 and MiMo use to draft) that module drafts every token, as in vLLM. Later modules see only
their rows of the current draft. Rows of a draft are dropped at commit.

`mtp_draft_vocab N` drafts over the N lowest token ids (a byte-level BPE vocabulary numbers its merges in the
order learnt, most frequent first) plus the end-of-turn tokens: the output head, most of a one-layer module's
cost on a CPU, shrinks to those rows. Verification still uses the full head, so the output cannot change.

A family may ship its MTP as an assistant model beside the target instead (Gemma 4; drafters/assistant.py):
`create` hands over to that drafter when it finds one.

In a batched step (the server's), the requests drafting with the same modules share each forward, catch-up and
drafted positions alike, where the modules are batch-invariant: every matmul w4a8, attention in the fixed-order
kernel (models/batch_invariance.py). Each request then drafts bit for bit what it drafts alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specdecode.drafters.assistant import AssistantDrafter, assistant_path
from specdecode.drafters.base import Drafter, DrafterCaps, DrafterResources, NoOptions, option
from specdecode.drafters.capabilities import AutoMember, Batching, MemorySizing
from specdecode.drafters.hidden_drafting import draft_chains, read_pending
from specdecode.drafters.registry import register
from specdecode.errors import SpecDecodeError
from specdecode.models.batch_invariance import batch_invariant_mtp
from specdecode.models.decoder.kv_cache import CacheBatch, KVCache
from specdecode.models.decoder.transformer import Transformer
from specdecode.models.families.registry import family_of
from specdecode.models.heads.draft_vocab import frequent_ids, reduced_head, spread_to_vocab
from specdecode.models.loader import module_bytes
from specdecode.spec_types import DraftProposal, Sequence, TargetOutput, VerifyResult

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MTPOptions(NoOptions):
    # 16000 by default: on the default target in w4a8 it drafts at 1.05x plain decoding where the whole
    # vocabulary's head makes it 0.95x (docs/benchmarks, 2026-12-03); a model with a smaller vocabulary keeps its own.
    mtp_draft_vocab: int = option(16000, "draft over the N lowest token ids (a byte-level BPE numbers its merges "
                                  "most frequent first) and the end-of-turn tokens only (0 = the whole "
                                  "vocabulary); verification still uses the full output head", ge=0)


@dataclass
class MTPState:
    """One request's MTP state."""

    caches: list[KVCache]  # one per module: module 0's rows for positions 0..fed-1, then a draft's rows
    fed: int  # committed positions module 0 has read
    pending: torch.Tensor  # [R, H] the target's final hidden states of positions fed..fed+R-1, not read yet
    logits: torch.Tensor | None = None  # [Vd] module 0's output at its last committed row: the first draft
    hidden: torch.Tensor | None = None  # [H] what that row feeds back to the next module


@register
class MTPDrafter(Drafter, AutoMember, Batching, MemorySizing):
    name = "mtp"
    auto_rank = 2  # the model's own layers: the first model drafter, as the seed advises
    caps = DrafterCaps(final_hidden=True, emits_probs=True, draft_files=True)
    Options = MTPOptions
    aliases = ("draft-mtp",)
    vllm_method = "mtp"

    def __init__(self, target: Transformer, options: MTPOptions, draft_head: nn.Module | None,
                 draft_to_target: torch.Tensor | None, companion: nn.ModuleList | None = None):
        self.target = target
        self.options = options
        self.companion = companion  # modules from a companion file (mtp_companion.py); None: the target's own
        shipped = target.mtp if companion is None else companion
        self.modules = len(shipped)
        self.draft_head = draft_head  # None: the target's own head, over the whole vocabulary
        self.draft_to_target = draft_to_target  # [Vd] long: the target id of each draft-head row
        # The modules as they run: with fixed-order attention where that makes them batch-invariant (w4a8), so a
        # batch of requests drafts in shared forwards exactly what each drafts alone; else as shipped.
        fixed = batch_invariant_mtp(shipped, target.lm_head if draft_head is None else draft_head, target.dtype)
        self.batch_invariant = fixed is not None
        self.running = shipped if fixed is None else fixed

    @classmethod
    def found_for(cls, resources: DrafterResources) -> str | None:
        if resources.target.config.mtp_layers:
            return "the target ships MTP layers"
        assistant = assistant_path(resources)
        if assistant is not None:
            return f"the {family_of(resources.target.config).assistant.title} {assistant}"
        path = _companion_path(resources)
        return None if path is None else f"MTP layers in {path}"

    @classmethod
    def check_resources(cls, resources: DrafterResources, options: MTPOptions | None = None) -> None:
        """Its layers come inside the target or in a companion file (--draft-head optional): the target's config
        and the companion's path say whether there can be any, without reading them (`create` reads them)."""
        if cls.found_for(resources) is None:
            raise SpecDecodeError(_no_mtp_layers(resources))

    @classmethod
    def create(cls, resources: DrafterResources, options: MTPOptions) -> Drafter:
        model = resources.target.model
        config = model.config
        if not config.mtp_layers and assistant_path(resources) is not None:  # its family ships an assistant
            return AssistantDrafter.create(resources, options)
        companion = _companion(resources)
        if not config.mtp_layers and companion is None:
            raise SpecDecodeError(_no_mtp_layers(resources))
        if not options.mtp_draft_vocab or options.mtp_draft_vocab >= config.vocab_size:
            return cls(model, options, None, None, companion)
        ids = frequent_ids(options.mtp_draft_vocab, config.vocab_size, resources.target.tokenizer.eos_token_ids)
        key = f"mtp-head:{options.mtp_draft_vocab}"
        if key not in resources.own_weights:  # one copy per Engine, whatever else a configuration differs in
            resources.own_weights[key] = reduced_head(model, ids, resources.draft_quant)
        return cls(model, options, resources.own_weights[key], ids.to(model.device), companion)

    def start(self, seq: Sequence, prefill: TargetOutput) -> None:
        room = seq.capacity + seq.draft_limit
        caches = [self.target.new_mtp_cache(room) for _ in range(self.modules)]
        state = MTPState(caches, 0, prefill.final_hidden)
        seq.drafter_state[self.name] = state
        self._read_pending([seq], [state])  # the prompt now, in the prefill phase

    def propose(self, seq: Sequence, budget: int) -> DraftProposal:
        return self._chains([seq], [budget])[0]

    def propose_many(self, seqs: list[Sequence], budgets: list[int]) -> list[DraftProposal]:
        """Chains for several requests in shared forwards (one catch-up, then one per drafted position) where
        the modules are batch-invariant, so each chain is what that request drafts alone; else one by one."""
        if not self.batch_invariant:
            return super().propose_many(seqs, budgets)
        return self.proposals_for_asked(seqs, budgets, self._chains)

    def _chains(self, seqs: list[Sequence], budgets: list[int]) -> list[DraftProposal]:
        states = [seq.drafter_state[self.name] for seq in seqs]
        self._read_pending(seqs, states)
        device = self.target.device

        def step(index: int, going: list[int], tokens: torch.Tensor, hidden: torch.Tensor):
            module = min(index, self.modules - 1)
            if module < index:
                for b in going:
                    seqs[b].note("mtp_module_reused")
            # [F, 1] each: one position on per step
            positions = torch.tensor([[len(seqs[b].tokens) - 2 + index] for b in going], device=device)
            caches = [states[b].caches[module] for b in going]
            logits, fed_back = self._module(module, tokens.view(-1, 1).to(device), hidden.unsqueeze(1), positions,
                                            caches[0] if len(caches) == 1 else CacheBatch(caches))
            return self._target_logits(logits[:, -1]), fed_back[:, -1]  # [F, V], [F, H]

        return draft_chains(seqs, budgets, [self._target_logits(state.logits) for state in states],
                            [state.hidden for state in states], step, self.name)

    def commit(self, seq: Sequence, result: VerifyResult, target: TargetOutput) -> None:
        state = seq.drafter_state[self.name]
        state.caches[0].truncate(state.fed)  # a draft's rows go; the target's rows of the path come in
        for cache in state.caches[1:]:
            cache.truncate(0)
        state.pending = torch.cat([state.pending, target.final_hidden])

    def request_bytes(self, seq: Sequence) -> int:
        state = seq.drafter_state.get(self.name)
        return sum(cache.nbytes for cache in state.caches) if state is not None else 0

    def weights_bytes(self) -> int:
        """A reduced draft head's rows and a companion file's modules (the target's own count with it)."""
        return sum(module_bytes(part) for part in (self.draft_head, self.companion) if part is not None)

    def _read_pending(self, seqs: list[Sequence], states: list[MTPState]) -> None:
        """Feed module 0 every committed position it has not read (hidden_drafting.read_pending)."""

        def forward(tokens, hidden, positions, cache, last):
            return self._module(0, tokens, hidden, positions, cache, logits_at=last)

        read_pending(seqs, states, [state.caches[0] for state in states], forward, self.target.device)

    def _module(self, index: int, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                cache: KVCache | CacheBatch, logits_at: torch.Tensor | slice = slice(-1, None)
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Module `index` over tokens [B, T] and hidden [B, T, H] at positions [B, T]; logits at `logits_at` (the
        last row unless told), through the draft head. -> (logits [B, 1, Vd], fed-back hidden [B, T, H])."""
        with torch.inference_mode():
            return self.target.mtp_forward(index, tokens, hidden, positions, cache, logits_at=logits_at,
                                           head=self.draft_head, modules=self.running)

    def _target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-head logits [Vd] -> [V] (sampling.spread_to_vocab)."""
        if self.draft_to_target is None:
            return logits
        return spread_to_vocab(logits, self.draft_to_target, self.target.config.vocab_size)


def _no_mtp_layers(resources: DrafterResources) -> str:
    config = resources.target.model.config
    dropped = (f"; its config declares {config.mtp_declared} but the weights do not hold them (a conversion or "
               "quantized upload dropped them)") if config.mtp_declared else ""
    return (f"method 'mtp' needs a model that ships MTP layers, and {resources.target.name} has none{dropped}, nor "
            "an MTP companion file (llama.cpp's mtp-NAME.gguf) or a Gemma 4 assistant folder beside it or given with "
            "--draft-model; `specdecode "
            "inspect MODEL` lists what a model can use, and `specdecode train mtp` trains them onto a model")


def _companion_path(resources: DrafterResources) -> Path | None:
    """The companion file holding MTP modules for the target: the one given (--draft-model, or --draft-head
    mtp=PATH), else, for a target loaded from a GGUF file without MTP layers of its own, one beside it
    (mtp-*.gguf); None without either. One path given for every drafter (--draft-head PATH) is this one's only
    when it is a GGUF file: a folder there is another drafter's (auto pairs a model's MTP layers with an EAGLE-3
    head that way)."""
    from specdecode.models.formats.mtp_companion import companion_beside

    model = resources.target.model
    given = resources.path_for("mtp")
    if given is not None and not isinstance(resources.draft_path, dict) and not str(given).lower().endswith(".gguf"):
        given = None
    if given is not None:
        return Path(given).expanduser()
    if model.config.mtp_layers or not resources.target.name.lower().endswith(".gguf"):
        return None
    return companion_beside(Path(resources.target.name).expanduser())


def _companion(resources: DrafterResources) -> nn.ModuleList | None:
    """The MTP modules of the companion file (_companion_path), loaded once per Engine; None without one."""
    from specdecode.models.model_files import load_companion

    path = _companion_path(resources)
    if path is None:
        return None
    model = resources.target.model
    key = f"mtp:{path.resolve()}"
    if key not in resources.own_weights:  # one copy per Engine, whatever else a configuration differs in
        modules, description = load_companion(path, model, resources.draft_quant)
        log.info("%s", description)
        resources.own_weights[key] = modules
    return resources.own_weights[key]

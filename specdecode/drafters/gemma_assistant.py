"""MTP on Gemma 4: the assistant Google ships with the model (models/heads/gemma_assistant.py) drafts a chain from
the target's last final hidden state and KV cache, as transformers' Gemma4AssistantCandidateGenerator does.

It is how method `mtp` runs on a Gemma 4 target (MTPDrafter.create hands over when it finds an assistant), so it
answers to that name. Per request it keeps one hidden state: the target's final one at the position before the
last committed token. Each proposal runs the assistant once per drafted token at that token's position, over the
target's cache as verification left it (the committed tokens but the last); it writes nothing, so nothing rolls
back after verification.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from specdecode.drafters.base import Drafter, DrafterCaps, DrafterResources
from specdecode.drafters.capabilities import MemorySizing
from specdecode.drafters.hidden_drafting import draft_chains
from specdecode.errors import SpecDecodeError
from specdecode.models.formats.gemma_assistant import is_assistant_folder, load_assistant
from specdecode.models.heads.gemma_assistant import GemmaAssistant
from specdecode.models.loader import module_bytes
from specdecode.models.survey import drafters_beside
from specdecode.spec_types import DraftProposal, Sequence, TargetOutput, VerifyResult

log = logging.getLogger(__name__)


class GemmaAssistantDrafter(Drafter, MemorySizing):
    name = "mtp"
    caps = DrafterCaps(final_hidden=True, emits_probs=True, draft_files=True)

    def __init__(self, target, assistant: GemmaAssistant):
        self.target = target  # the GemmaTransformer
        self.assistant = assistant
        self.slots = {kind: target.shared_slot(kind) for kind in set(assistant.config.layer_types)}

    @classmethod
    def create(cls, resources: DrafterResources, options=None) -> GemmaAssistantDrafter:
        """The drafter over the assistant `assistant_path` finds for the target, loaded once per Engine."""
        path = assistant_path(resources)
        if path is None:
            raise SpecDecodeError("no Gemma 4 assistant found beside the target (--draft-head mtp=PATH names one)")
        model = resources.target.model
        key = f"gemma4-assistant:{path.resolve()}"
        if key not in resources.own_weights:  # one copy per Engine, whatever else a configuration differs in
            assistant, description = load_assistant(path, model.config, model.dtype, model.device,
                                                    resources.draft_quant)
            resources.own_weights[key] = assistant
            log.info("%s", description)
        return cls(model, resources.own_weights[key])

    def start(self, seq: Sequence, prefill: TargetOutput) -> None:
        seq.drafter_state[self.name] = prefill.final_hidden[-1:].unsqueeze(0)  # [1, 1, B]

    def propose(self, seq: Sequence, budget: int) -> DraftProposal:
        position = len(seq.tokens) - 1  # the last token's: the target's cache holds those before it
        hidden = seq.drafter_state[self.name]

        def run(token: int, fed_back: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            embedding = self.target.embed_scaled(torch.tensor([[token]], device=self.target.device))  # [1, 1, B]
            logits, out = self.assistant(embedding, fed_back.view(1, 1, -1), position, seq.cache, self.slots)
            return logits, out[0, 0]  # [V], [B]

        def step(index: int, going: list[int], tokens: torch.Tensor, fed_back: torch.Tensor):
            logits, out = run(int(tokens[0]), fed_back[0])
            return logits.unsqueeze(0), out.unsqueeze(0)  # [1, V], [1, B]

        with torch.inference_mode():
            first_logits, first_hidden = run(seq.tokens[-1], hidden)
        return draft_chains([seq], [budget], [first_logits], [first_hidden], step, self.name)[0]

    def commit(self, seq: Sequence, result: VerifyResult, target: TargetOutput) -> None:
        seq.drafter_state[self.name] = target.final_hidden[-1:].unsqueeze(0)  # the last accepted row's

    def weights_bytes(self) -> int:
        return module_bytes(self.assistant)


def assistant_path(resources: DrafterResources) -> Path | None:
    """The Gemma 4 assistant folder for a Gemma 4 target: the one given (--draft-model, or --draft-head
    mtp=PATH), else one beside the target (a sibling or subfolder whose config says gemma4_assistant, as
    `google/gemma-4-e2b-it-assistant` sits beside `google/gemma-4-e2b-it`); None without either."""
    if not resources.target.config.is_gemma:
        return None
    given = resources.path_for("mtp")
    if given is not None and is_assistant_folder(Path(given).expanduser()):
        return Path(given).expanduser()
    source = Path(resources.target.name).expanduser()
    if not source.exists():
        return None
    return next((folder for kind, folder in drafters_beside(source, []) if kind == "gemma4_assistant"), None)

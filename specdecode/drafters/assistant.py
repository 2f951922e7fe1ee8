"""MTP through an assistant model the target's family ships beside it (Gemma 4's: families/gemma4/), drafting a
chain from the target's last final hidden state and KV cache, as transformers' Gemma4AssistantCandidateGenerator
does.

It is how method `mtp` runs on such a target (MTPDrafter.create hands over when it finds an assistant), so it
answers to that name. Per request it keeps one hidden state: the target's final one at the position before the
last committed token. Each proposal runs the assistant once per drafted token at that token's position, over the
target's cache as verification left it (the committed tokens but the last); it writes nothing, so nothing rolls
back after verification. What the assistant is, and how one drafted token runs, the family says
(families/base.py's ShippedAssistant).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from specdecode.drafters.base import Drafter, DrafterCaps, DrafterResources
from specdecode.drafters.capabilities import MemorySizing
from specdecode.drafters.hidden_drafting import draft_chains
from specdecode.errors import SpecDecodeError
from specdecode.models.families.base import AssistantStep
from specdecode.models.families.registry import family_of
from specdecode.models.loader import module_bytes
from specdecode.models.survey import drafters_beside
from specdecode.spec_types import DraftProposal, Sequence, TargetOutput, VerifyResult

log = logging.getLogger(__name__)


class AssistantDrafter(Drafter, MemorySizing):
    name = "mtp"
    caps = DrafterCaps(final_hidden=True, emits_probs=True, draft_files=True)

    def __init__(self, run: AssistantStep, assistant: torch.nn.Module):
        self.run = run  # one drafted token on: the family's drafting step over this assistant
        self.assistant = assistant

    @classmethod
    def create(cls, resources: DrafterResources, options=None) -> AssistantDrafter:
        """The drafter over the assistant `assistant_path` finds for the target, loaded once per Engine."""
        path = assistant_path(resources)
        if path is None:
            raise SpecDecodeError("no assistant found beside the target (--draft-head mtp=PATH names one)")
        model = resources.target.model
        shipped = family_of(model.config).assistant
        key = f"assistant:{path.resolve()}"
        if key not in resources.own_weights:  # one copy per Engine, whatever else a configuration differs in
            assistant, description = shipped.load(path, model, resources.draft_quant)
            resources.own_weights[key] = assistant
            log.info("%s", description)
        assistant = resources.own_weights[key]
        return cls(shipped.drafting_step(model, assistant), assistant)

    def start(self, seq: Sequence, prefill: TargetOutput) -> None:
        seq.drafter_state[self.name] = prefill.final_hidden[-1:].unsqueeze(0)  # [1, 1, H]

    def propose(self, seq: Sequence, budget: int) -> DraftProposal:
        position = len(seq.tokens) - 1  # the last token's: the target's cache holds those before it
        hidden = seq.drafter_state[self.name]

        def step(index: int, going: list[int], tokens: torch.Tensor, fed_back: torch.Tensor):
            logits, out = self.run(int(tokens[0]), fed_back[0], position, seq.cache)
            return logits.unsqueeze(0), out.unsqueeze(0)  # [1, V], [1, H]

        with torch.inference_mode():
            first_logits, first_hidden = self.run(seq.tokens[-1], hidden, position, seq.cache)
        return draft_chains([seq], [budget], [first_logits], [first_hidden], step, self.name)[0]

    def commit(self, seq: Sequence, result: VerifyResult, target: TargetOutput) -> None:
        seq.drafter_state[self.name] = target.final_hidden[-1:].unsqueeze(0)  # the last accepted row's

    def weights_bytes(self) -> int:
        return module_bytes(self.assistant)


def assistant_path(resources: DrafterResources) -> Path | None:
    """The assistant folder for a target whose family ships one: the one given (--draft-model, or --draft-head
    mtp=PATH), else one beside the target (a sibling or subfolder whose config names it, as
    `google/gemma-4-e2b-it-assistant` sits beside `google/gemma-4-e2b-it`); None without either."""
    shipped = family_of(resources.target.config).assistant
    if shipped is None:
        return None
    given = resources.path_for("mtp")
    if given is not None and shipped.is_assistant(Path(given).expanduser()):
        return Path(given).expanduser()
    source = Path(resources.target.name).expanduser()
    if not source.exists():
        return None
    return next((folder for kind, folder in drafters_beside(source, []) if kind == shipped.kind), None)

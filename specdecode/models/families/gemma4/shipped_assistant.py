"""Gemma 4's assistant as the family declares it (families/base.py's ShippedAssistant): how to recognise one, load
it for a target (assistant_format.py) and run it one drafted token on over the target's cache (assistant.py), as
transformers' Gemma4AssistantCandidateGenerator does."""

from __future__ import annotations

from pathlib import Path

import torch

from specdecode.models.families.base import AssistantStep, ShippedAssistant
from specdecode.models.families.gemma4.assistant import GemmaAssistant
from specdecode.models.families.gemma4.assistant_format import is_assistant_folder, load_assistant
from specdecode.models.families.gemma4.trunk import GemmaTransformer


class GemmaShippedAssistant(ShippedAssistant):
    kind = "gemma4_assistant"
    title = "Gemma 4 assistant"
    marker = "gemma4assistant"

    def is_assistant(self, path: Path) -> bool:
        return is_assistant_folder(path)

    def load(self, path: Path, target: GemmaTransformer, quant: str) -> tuple[GemmaAssistant, str]:
        return load_assistant(path, target.config, target.dtype, target.device, quant)

    def drafting_step(self, target: GemmaTransformer, assistant: GemmaAssistant) -> AssistantStep:
        # Each of its layers reads the target's last layer of its kind (the KV-shared slots).
        slots = {kind: target.shared_slot(kind) for kind in set(assistant.config.layer_types)}

        def run(token: int, fed_back: torch.Tensor, position: int, cache) -> tuple[torch.Tensor, torch.Tensor]:
            embedding = target.embed_scaled(torch.tensor([[token]], device=target.device))  # [1, 1, H]
            logits, out = assistant(embedding, fed_back.view(1, 1, -1), position, cache, slots)
            return logits, out[0, 0]  # [V], [H]

        return run

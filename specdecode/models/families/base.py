"""What a model family declares: how it is recognised, its config, trunk, tensor maps per layout, cache kind and
kernels. The loader, the formats and the kernels ask a model's family (families/__init__.py: `family_of`)
instead of testing which family it is, so a new family is a folder of its own and one registration.

A family reads every layout through Hugging Face names: a GGUF file's tensors are renamed (and, where llama.cpp's
converter reordered or re-valued them, put back) to the names and values a Hugging Face checkpoint holds, so the
family's tensor maps (`sources`, `shapes`) serve both layouts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch
    from torch import nn

    from specdecode.models.decoder.transformer import Transformer
    from specdecode.models.formats.gguf_layout import GGUFLayout
    from specdecode.models.model_config import ModelConfig

# (metadata key without the architecture's prefix, default) -> its value: a GGUF file's `{arch}.*` fields
GGUFMeta = Callable[..., object]


class ShippedAssistant(ABC):
    """A drafter model a family ships beside its models (Gemma 4's assistant), drafting from the target's final
    hidden state over the target's own KV cache; drafters/assistant.py runs it as method `mtp`."""

    kind: ClassVar[str]  # what `inspect` and the survey call a folder holding one
    title: ClassVar[str]  # what messages call it ("Gemma 4 assistant")
    marker: ClassVar[str]  # how its config.json's architectures name it, in lower case

    @abstractmethod
    def is_assistant(self, path: Path) -> bool:
        """Whether `path` (a folder or a file) holds one."""

    @abstractmethod
    def load(self, path: Path, target: Transformer, quant: str) -> tuple[nn.Module, str]:
        """-> (the assistant for `target`, in its dtype and device, its linear layers in `quant`; a line saying
        what was loaded). One error where it was made for another target."""

    @abstractmethod
    def drafting_step(self, target: Transformer, assistant: nn.Module) -> AssistantStep:
        """The function that runs `assistant` one drafted token on."""


# (the token drafted last, the hidden state fed back [H], its position, the target's cache) -> (logits [V], the
# hidden state to feed back [H])
AssistantStep = Callable[[int, "torch.Tensor", int, object], tuple["torch.Tensor", "torch.Tensor"]]


class ModelFamily(ABC):
    name: ClassVar[str]
    # config.json's model_type -> our architecture name (a family may run several: Llama, Mistral, Qwen2, ...)
    model_types: ClassVar[dict[str, str]]
    # GGUF general.architecture -> our architecture name
    gguf_architectures: ClassVar[dict[str, str]] = {}
    # known model types or GGUF architectures of this family that we do not run, with why (inspect says it)
    not_supported: ClassVar[dict[str, str]] = {}
    # what a request's cache holds: "kv" (keys and values per token), "kv+recurrent" (and per-row recurrent
    # states), "kv-shared" (layers reading others' keys and values), "latent" (compressed latents)
    cache_kind: ClassVar[str] = "kv"
    assistant: ClassVar[ShippedAssistant | None] = None  # a drafter model it ships beside its models, if any

    # --- config ---
    @abstractmethod
    def config_from_hf(self, hf: dict, model_type: str) -> ModelConfig:
        """Our config from a Hugging Face config.json dict (its text part), for `model_type` (one of ours)."""

    @abstractmethod
    def config_to_hf(self, config: ModelConfig) -> dict:
        """The config.json we write beside converted weights, readable by transformers too."""

    def config_from_gguf(self, meta: GGUFMeta, architecture: str, tensors: dict, tokens: dict, path: Path,
                         companion: bool = False) -> ModelConfig:
        """Our config from a GGUF file of `architecture`: its `{architecture}.*` metadata (`meta(key, default)`),
        its tensors by name and its tokenizer's ids (`tokens`: "bos", "eos"); `companion`: the file may hold MTP
        layers alone (llama.cpp's --mtp companion)."""
        raise NotImplementedError(f"{self.name} reads no GGUF files")

    def parameter_count(self, config: ModelConfig) -> int:
        """Weights the architecture holds, from its sizes (a quantized model's buffers would miscount them)."""
        return sum(_product(shape) for name, shape in self.shapes(config).items() if name in self.stored(config))

    # --- weights ---
    @abstractmethod
    def sources(self, config: ModelConfig) -> dict[str, list[str]]:
        """Each of our parameter names -> the Hugging Face names (without "model.") stacked into it, in order."""

    @abstractmethod
    def shapes(self, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every Hugging Face tensor name (without "model.") -> the shape the config implies for it."""

    def stored(self, config: ModelConfig) -> set[str]:
        """The Hugging Face names the weights hold for `config` (what `sources` reads)."""
        return {name for names in self.sources(config).values() for name in names}

    def unread(self, config: ModelConfig, name: str) -> bool:
        """Whether stored tensor `name` may sit in a checkpoint without being read (a vision tower, a tied head's
        copy, an MTP module's copies of the trunk's embedding)."""
        return False

    def mtp_names(self, config: ModelConfig) -> set[str]:
        """The stored names of the MTP modules the config declares (all present or none, model_files checks);
        none for a family that ships no MTP layers."""
        return set()

    # --- GGUF ---
    def gguf_layout(self, config: ModelConfig, architecture: str) -> GGUFLayout:
        """How a GGUF file of `architecture` (one of gguf_architectures) stores this family's tensors."""
        raise NotImplementedError(f"{self.name} reads no GGUF files")

    def tokenizer_from_gguf_alone(self) -> bool:
        """Whether the tokenizer must be built from the GGUF vocabulary alone (transformers cannot read this
        family's model config from the file)."""
        return False

    # --- runtime ---
    @abstractmethod
    def build(self, config: ModelConfig) -> Transformer:
        """The trunk, its weights not loaded (called under torch.device("meta") to allocate none)."""

    def fuse_w4a8(self, model: Transformer) -> None:
        """Replace decoder layers by fused w4a8 ones where every matmul of them is w4a8 (kernels/)."""

    def fix_float(self, model: Transformer) -> str | None:
        """Make a float model's layers batch-invariant where this machine allows; -> None, or why not."""
        return "no fixed-order layers for this family"

    def batch_invariant(self, model: Transformer) -> bool:
        """Whether a token's logits are bitwise the same however many rows share its forward."""
        return False



def _product(shape: tuple[int, ...]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total

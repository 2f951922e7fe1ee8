"""Which models can draft for a target: the same vocabulary (the rule `draft` enforces) and fewer weights.

Read from headers and tokenizer files only, no weights loaded: a GGUF file's token list and tensor shapes, a
folder's tokenizer, config.json and safetensors headers. LM Studio's pairing advice does the same from its catalogue.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from specdecode.errors import SpecDecodeError
from specdecode.models.formats.default_models import DEFAULT_DRAFT, DEFAULT_MODELS, status
from specdecode.models.formats.gguf_header import TOKENS_KEY, read_header

# Above this share of the target's weights a draft rarely pays: each drafted token costs too much of a step.
MAX_USEFUL_RATIO = 0.5


@dataclass
class ModelFacts:
    name: str
    parameters: int
    tokens: list[str]


@dataclass
class Pairing:
    candidate: ModelFacts
    ratio: float  # the candidate's parameters over the target's
    can_draft: bool  # `draft` accepts it (same vocabulary, smaller)
    note: str


def model_facts(name: str) -> ModelFacts:
    """A default name (assembled if needed), a .gguf file or a model folder -> its size and vocabulary."""
    # Here, not at the top: the loader imports torch, and `specdecode models` without --drafts-for needs none.
    from specdecode.models.formats import safetensors_read
    from specdecode.models.loader import read_config, resolve_source, safetensors_files
    from specdecode.models.tokenizer import Tokenizer

    path = resolve_source(name, quiet=False)  # a .gguf file or a folder with config.json, or a clear error
    if path.is_file():
        header = read_header(path, with_tokens=True)
        if header.tokens is None:
            raise SpecDecodeError(f"{path} has no vocabulary ({TOKENS_KEY} is missing)")
        return ModelFacts(name, header.parameters, header.tokens)
    config = read_config(path)
    # Every weight the files hold, as a GGUF file's header counts them; from headers checked against the files, so
    # a damaged one is one clear error here, not a verdict on a model that cannot load.
    parameters = sum(prod(entry.shape) for file in safetensors_files(path)
                     for entry in safetensors_read.read_header(file)[0].values())
    return ModelFacts(name, parameters, Tokenizer.from_folder(path, config).token_strings())


def installed_defaults() -> list[str]:
    """The default models whose packages are installed (those not assembled yet are, with progress bars)."""
    return [name for name, model in DEFAULT_MODELS.items() if status(model) != "parts missing"]


def pair(target: ModelFacts, candidate: ModelFacts) -> Pairing:
    ratio = candidate.parameters / target.parameters if target.parameters else float("inf")
    if candidate.tokens != target.tokens:
        shared = min(len(candidate.tokens), len(target.tokens))
        first = next((i for i in range(shared) if candidate.tokens[i] != target.tokens[i]), shared)
        return Pairing(candidate, ratio, False, f"vocabulary differs ({len(candidate.tokens)} tokens against "
                                                f"{len(target.tokens)}, first at id {first})")
    if ratio >= 1:
        return Pairing(candidate, ratio, False, "not smaller than the target")
    if ratio > MAX_USEFUL_RATIO:
        return Pairing(candidate, ratio, True, "same vocabulary, but over half the target's size: unlikely to pay")
    return Pairing(candidate, ratio, True, "same vocabulary")


def sibling_draft(target: str | None) -> str | None:
    """The draft model `auto` takes for `target` (None: the default target) when none is named: for the default
    target, the default draft whenever its package is installed; else the smallest default model already
    assembled with the target's vocabulary and at most MAX_USEFUL_RATIO of its weights."""
    installed = installed_defaults()
    if target is None:  # the default pair was chosen together
        return DEFAULT_DRAFT if DEFAULT_DRAFT in installed else None
    # Only defaults already assembled: auto is the default method, and checking a pairing must not assemble a
    # gigabyte file from its package before every run of another model (`specdecode models --drafts-for` does).
    ready = [name for name in installed if name != target and name in DEFAULT_MODELS
             and status(DEFAULT_MODELS[name]) == "assembled"]
    if not ready:
        return None
    facts = model_facts(target)
    usable = [p for p in (pair(facts, model_facts(name)) for name in ready)
              if p.can_draft and p.ratio <= MAX_USEFUL_RATIO]
    return min(usable, key=lambda p: p.ratio).candidate.name if usable else None

"""The registered model families, and the questions the rest of the runtime asks them: which family a config,
a config.json model_type or a GGUF architecture belongs to; its config read from a Hugging Face dict.

Families register themselves (`register_family`) when families/__init__.py imports them; a family added outside
the package (a test's toy one) registers the same way.
"""

from __future__ import annotations

from specdecode.errors import SpecDecodeError
from specdecode.models.families.base import ModelFamily
from specdecode.models.model_config import ModelConfig

FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    """Add `family` under its name; a model_type or GGUF architecture another family claims is refused."""
    taken = {name: other.name for other in FAMILIES.values() for name in other.model_types}
    taken_gguf = {name: other.name for other in FAMILIES.values() for name in other.gguf_architectures}
    clash = [name for name in family.model_types if taken.get(name, family.name) != family.name]
    clash += [name for name in family.gguf_architectures if taken_gguf.get(name, family.name) != family.name]
    if clash:
        raise ValueError(f"family {family.name!r} claims {', '.join(clash)}, which another family reads")
    FAMILIES[family.name] = family
    return family


def architectures() -> dict[str, ModelFamily]:
    """Our architecture names -> the family that runs each."""
    return {arch: family for family in FAMILIES.values() for arch in family.model_types.values()}


def family_of(config: ModelConfig) -> ModelFamily:
    """The family that runs `config` (by its architecture)."""
    family = architectures().get(config.architecture)
    if family is None:
        raise SpecDecodeError(unsupported_message(config.architecture))
    return family


def family_for_model_type(model_type: str | None) -> ModelFamily | None:
    return next((f for f in FAMILIES.values() if model_type in f.model_types), None)


def family_for_gguf(architecture: str | None) -> ModelFamily | None:
    return next((f for f in FAMILIES.values() if architecture in f.gguf_architectures), None)


def runs(name: str | None) -> bool:
    """Whether a config.json model_type or a GGUF architecture is one we run."""
    return family_for_model_type(name) is not None or family_for_gguf(name) is not None


def supported() -> list[str]:
    """Our architecture names, for messages."""
    return list(dict.fromkeys(architectures()))


def why_not_run(name: str | None) -> str | None:
    """Why a known model_type or GGUF architecture is not run here (a family says), or None."""
    return next((f.not_supported[name] for f in FAMILIES.values() if name in f.not_supported), None)


def unsupported_message(name: str | None) -> str:
    why = why_not_run(name)
    return f"unsupported architecture {name!r}{f' ({why})' if why else ''}; supported: {', '.join(supported())}"


def config_from_hf(hf: dict) -> ModelConfig:
    """Our config from a Hugging Face config.json dict; a missing or malformed field is one clear error."""
    hf = text_config(hf)
    model_type = hf.get("model_type")
    family = family_for_model_type(model_type)
    if family is None:
        raise SpecDecodeError(unsupported_message(model_type or str(hf.get("architectures"))))
    try:
        return family.config_from_hf(hf, model_type)
    except (KeyError, TypeError, ValueError, AttributeError, ArithmeticError) as error:
        raise SpecDecodeError(f"config.json is missing or has a malformed field ({error!r})") from None


def config_to_hf(config: ModelConfig) -> dict:
    """The config.json we write next to converted weights, readable by transformers too."""
    return family_of(config).config_to_hf(config)


def text_config(hf: dict) -> dict:
    """A multimodal checkpoint's language model config (its text_config), with the top level's token ids where the
    text part leaves them out; any other config as it is."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        return hf
    inherited = {key: hf[key] for key in ("bos_token_id", "eos_token_id", "tie_word_embeddings") if key in hf}
    return inherited | text

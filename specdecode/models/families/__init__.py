"""Model families, registered like drafters: each declares in its own folder how it is recognised (config.json
model types, GGUF architectures), its config reader, its trunk, its tensor maps per layout, its cache kind and the
kernels it runs on (base.py). The rest of the runtime asks a model's family (registry.py) instead of testing which
one it is, so a family is its folder plus its registration. Families do not import one another; the layers they
share live in models/decoder, models/formats and models/kernels. Importing this package registers them."""

from specdecode.models.families import deepseek_v3, gemma4, glm4_moe, llama, qwen3_5, qwen3_moe  # noqa: F401 - imported to register the families
from specdecode.models.families.base import ModelFamily, ShippedAssistant
from specdecode.models.families.registry import (
    FAMILIES,
    config_from_hf,
    config_to_hf,
    family_for_gguf,
    family_for_model_type,
    family_of,
    register_family,
    runs,
    unsupported_message,
)

__all__ = ["FAMILIES", "ModelFamily", "ShippedAssistant", "config_from_hf", "config_to_hf", "family_for_gguf",
           "family_for_model_type", "family_of", "register_family", "runs", "unsupported_message"]

"""specdecode: lossless speculative decoding for open-weight LLMs.

    from specdecode import load_model, Engine, SamplingParams, SpecConfig
    target = load_model("qwen2.5-coder-1.5b-instruct")
    draft = load_model("qwen2.5-coder-0.5b-instruct")
    engine = Engine(target, draft, SpecConfig("ngram,draft"))
    for event in engine.generate("Write a quicksort in Python."):
        print(event.text, end="", flush=True)
"""

from specdecode.config import SamplingParams, SpecConfig
from specdecode.engine import Engine, GenerationEvent, GenerationResult
from specdecode.errors import SpecDecodeError
from specdecode.models.loader import LoadedModel, load_model

__all__ = ["Engine", "GenerationEvent", "GenerationResult", "LoadedModel", "SamplingParams", "SpecConfig",
           "SpecDecodeError", "load_model"]
__version__ = "0.1.0"

"""specdecode: lossless speculative decoding for open-weight LLMs.

    from specdecode import load_model, Engine, SamplingParams, SpecConfig
    target = load_model("qwen2.5-coder-1.5b-instruct")
    draft = load_model("qwen2.5-coder-0.5b-instruct")
    engine = Engine(target, draft, SpecConfig("ngram,draft"))
    for event in engine.generate("Write a quicksort in Python."):
        print(event.text, end="", flush=True)
"""

from importlib import import_module

_EXPORTS = {
    "Engine": "specdecode.engine.engine", "GenerationResult": "specdecode.engine.engine",
    "GenerationEvent": "specdecode.engine.request",
    "LoadedModel": "specdecode.models.loader", "load_model": "specdecode.models.loader",
    "SamplingParams": "specdecode.config", "SpecConfig": "specdecode.config", "SpecDecodeError": "specdecode.errors",
    "TokenLogprob": "specdecode.acceptance.logprobs",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    """The public names, imported on first use (PEP 562): `import specdecode.cli` then imports no torch, so
    the command line is inside its Ctrl-C handler before the slow imports begin."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'specdecode' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value

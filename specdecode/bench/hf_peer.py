"""Hugging Face transformers as a peer: plain generate, assisted generation and prompt lookup, same weights.

It loads the very folders our loader reads (GGUF sources are converted ones), in the same dtype, and gets
the same prompt ids, so the only difference left is the implementation.
"""

from __future__ import annotations

import torch

from specdecode.bench.runner import MethodSpec, TurnOutput, TurnRunner
from specdecode.config import SamplingParams
from specdecode.errors import SpecDecodeError
from specdecode.models.loader import LoadedModel, float_folder

HF_METHODS = ("hf:plain", "hf:assisted", "hf:prompt-lookup")


class HFPeer:
    def __init__(self, target: LoadedModel, draft: LoadedModel | None, prompt_lookup_tokens: int = 10):
        from transformers import AutoModelForCausalLM

        self.target = target
        self.model = self._load(AutoModelForCausalLM, target)
        self.assistant = self._load(AutoModelForCausalLM, draft) if draft is not None else None
        self.prompt_lookup_tokens = prompt_lookup_tokens

    @staticmethod
    def _load(auto_class, loaded: LoadedModel):
        """Float weights in our model's dtype: transformers has no kernels for our int8/int4 layers."""
        folder = float_folder(loaded.name, loaded.model.dtype)
        return auto_class.from_pretrained(str(folder), dtype=loaded.model.dtype).eval()

    def methods(self) -> list[MethodSpec]:
        specs = [MethodSpec("hf:plain", "hf", "hf:plain")]
        if self.assistant is not None:
            specs.append(MethodSpec("hf:assisted", "hf", "hf:plain"))
        specs.append(MethodSpec("hf:prompt-lookup", "hf", "hf:plain"))
        return specs

    def turn_runner(self, method: str, sampling: SamplingParams) -> TurnRunner:
        from transformers import GenerationConfig

        if method not in HF_METHODS or (method == "hf:assisted" and self.assistant is None):
            raise SpecDecodeError(f"unknown transformers method {method!r}; known: {', '.join(HF_METHODS)}")
        tokenizer = self.target.tokenizer
        eos = sorted(tokenizer.eos_token_ids)
        # An explicit config, so settings a model folder ships (repetition_penalty, ...) cannot creep in.
        settings = dict(max_new_tokens=sampling.max_tokens, eos_token_id=eos, pad_token_id=eos[0],
                        do_sample=not sampling.greedy)
        if not sampling.greedy:
            settings.update(temperature=sampling.temperature, top_k=sampling.top_k or None, top_p=sampling.top_p,
                            min_p=sampling.min_p or None)
        if method == "hf:prompt-lookup":
            settings["prompt_lookup_num_tokens"] = self.prompt_lookup_tokens
        extra = {"assistant_model": self.assistant} if method == "hf:assisted" else {}
        if sampling.stop:  # transformers keeps the stop string in its text; ids agree up to that token
            settings["stop_strings"] = list(sampling.stop)
            extra["tokenizer"] = tokenizer.hf
        if sampling.ignore_eos:
            settings["min_new_tokens"] = sampling.max_tokens  # transformers' way of generating past EOS
        config = GenerationConfig(**settings)

        def run_turn(messages: list[dict]) -> TurnOutput:
            prompt = torch.tensor([tokenizer.encode_chat(messages)])  # [1, P]
            with torch.inference_mode():
                output = self.model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                             generation_config=config, **extra)  # [1, P+N]
            ids = output[0, prompt.shape[1]:].tolist()
            return TurnOutput(tokenizer.decode(ids), len(ids), ids)

        return run_turn

"""How far each quantization moves the 1.5B target from its bf16 self, teacher-forced on its own bf16 output.

Run from the repository root: python docs/benchmarks/quant_quality.py [--prompts 3] [--max-tokens 128]

The bf16 target writes greedy answers to the first N HumanEval prompts; each quantized copy then reads the same
prompt + answer in one forward, and we count how often its top-1 token agrees with bf16's and the mean
KL(bf16 || quantized) of the next-token distributions over the answer positions.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specdecode import Engine, SamplingParams, SpecConfig, load_model
from specdecode.models.formats.default_models import DEFAULT_TARGET

PROMPTS = Path("../shared/data/humaneval/humaneval_specbench_format.jsonl")


@torch.inference_mode()
def answer_logits(model, ids: list[int], answer_start: int) -> torch.Tensor:
    """[A, V] float32 log-probabilities predicting each answer token."""
    tokens = torch.tensor([ids])  # [1, T]
    out = model(tokens, torch.arange(len(ids)).unsqueeze(0), model.new_cache(len(ids)))
    return torch.log_softmax(out.logits[0, answer_start - 1 : -1], dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    reference = load_model(DEFAULT_TARGET, quiet=True)
    engine = Engine(reference)
    sequences = []
    for line in PROMPTS.read_text().splitlines()[: args.prompts]:
        prompt = reference.tokenizer.encode_chat([{"role": "user", "content": json.loads(line)["turns"][0]}])
        answer = engine.complete(prompt, SamplingParams(max_tokens=args.max_tokens), SpecConfig("none")).token_ids
        sequences.append((prompt + answer, len(prompt)))
    expected = [answer_logits(reference.model, ids, start) for ids, start in sequences]
    print("| weights | top-1 agreement with bf16 | mean KL(bf16 || quantized), nats |\n|---|---|---|")
    for quant in ("int8", "int4", "w4a8"):
        model = load_model(DEFAULT_TARGET, quiet=True, quant=quant).model
        agree = total = 0
        kl = 0.0
        for (ids, start), reference_logp in zip(sequences, expected):
            logp = answer_logits(model, ids, start)
            agree += int((logp.argmax(-1) == reference_logp.argmax(-1)).sum())
            total += len(logp)
            kl += float((reference_logp.exp() * (reference_logp - logp)).sum())
        print(f"| {quant} | {agree / total:.1%} | {kl / total:.4f} |", flush=True)


if __name__ == "__main__":
    main()

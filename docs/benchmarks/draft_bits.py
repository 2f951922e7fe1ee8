"""How many bits the draft model's layers need: its top-1 agreement with the target, weights at 4, 3 and 2 bits.

Run from the repository root: python docs/benchmarks/draft_bits.py [--humaneval 6] [--max-tokens 128]

The target (w4a8) writes greedy answers to the first N HumanEval prompts and the first MT-bench question of each
category. The 0.5B draft then reads each prompt + answer in one forward, teacher-forced, and we count how often its
top-1 token is the target's next token: the first drafted position's acceptance. Each decoder-layer linear of the
float draft is replaced by its weights quantized per group of 32 inputs to b bits with a scale and an offset
(w = code * scale + offset, as the w4a8 kernel's layout), either from the group's min and max or with the clipping
range searched for the least squared error (searched_groups); the output head stays as loaded. The drafts as served
on the kernel (int8 activations too, the head quantized as well), w4a8 and w3a8, are the first rows.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from quant_quality import answer_logits
from torch import nn

from specdecode import Engine, SamplingParams, SpecConfig, load_model
from specdecode.models.formats.default_models import DEFAULT_DRAFT, DEFAULT_TARGET
from specdecode.models.kernels.quantized_linear import searched_groups

HUMANEVAL = Path("../shared/data/humaneval/humaneval_specbench_format.jsonl")
MT_BENCH = Path("../shared/data/mt_bench/question.jsonl")


def prompts(humaneval: int) -> list[str]:
    first_turns = [json.loads(line)["turns"][0] for line in HUMANEVAL.read_text().splitlines()[:humaneval]]
    categories: set[str] = set()
    for line in MT_BENCH.read_text().splitlines():
        question = json.loads(line)
        if question["category"] not in categories:
            categories.add(question["category"])
            first_turns.append(question["turns"][0])
    return first_turns


def quantized(weight: torch.Tensor, bits: int, search: bool) -> torch.Tensor:
    """[N, K] -> [N, K]: each group of 32 inputs at `bits` bits, dequantized back to float32."""
    codes, scales, offsets = searched_groups(weight, bits, 32, search)  # [N, K], [N, K/32] twice
    return codes * scales.repeat_interleave(32, dim=1) + offsets.repeat_interleave(32, dim=1)


def layer_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """name -> [out, in] float32 weight of every packed decoder-layer linear. oneDNN's packed layout is opaque, so
    the weight is read back as the layer's output for the identity (exact: one product per sum)."""
    weights = {}
    for name, module in model.named_modules():
        if type(module).__name__ == "PackedLinear":
            dtype = module.packed_weight.dtype
            outputs = module(torch.eye(module.in_features, dtype=dtype))  # [in, out]
            bias = module.bias if module.bias is not None else 0
            weights[name] = (outputs - bias).float().t().contiguous()
    return weights


def replace(model: nn.Module, name: str, weight: torch.Tensor, dtype: torch.dtype) -> None:
    modules = dict(model.named_modules())
    parent, _, child = name.rpartition(".")
    old = modules[name]
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=old.bias is not None, dtype=dtype)
    linear.weight.data.copy_(weight)
    if old.bias is not None:
        linear.bias.data.copy_(old.bias)
    setattr(modules[parent], child, linear)


@torch.inference_mode()
def agreement(model: nn.Module, sequences: list[tuple[list[int], int]]) -> float:
    agreed = total = 0
    for ids, start in sequences:
        predicted = answer_logits(model, ids, start).argmax(-1)  # [A]
        agreed += int((predicted == torch.tensor(ids[start:])).sum())
        total += len(ids) - start
    return agreed / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--humaneval", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    target = load_model(DEFAULT_TARGET, quiet=True, quant="w4a8")
    engine = Engine(target)
    sequences = []
    for text in prompts(args.humaneval):
        prompt = target.tokenizer.encode_chat([{"role": "user", "content": text}])
        answer = engine.complete(prompt, SamplingParams(max_tokens=args.max_tokens), SpecConfig("none")).token_ids
        sequences.append((prompt + answer, len(prompt)))
    print(f"{len(sequences)} answers, {sum(len(ids) - start for ids, start in sequences)} tokens\n")
    print("| draft layers | top-1 agreement with the target |\n|---|---|")
    for quant in ("w4a8", "w3a8"):
        served = load_model(DEFAULT_DRAFT, quiet=True, quant=quant).model
        print(f"| {quant} (the kernel, as served) | {agreement(served, sequences):.1%} |", flush=True)
    draft = load_model(DEFAULT_DRAFT, quiet=True, quant="none").model
    dtype = next(draft.parameters()).dtype
    weights = layer_weights(draft)
    print(f"| float ({dtype}) | {agreement(draft, sequences):.1%} |", flush=True)
    for bits, search in ((4, False), (3, False), (3, True), (2, True)):
        for name, weight in weights.items():
            replace(draft, name, quantized(weight, bits, search), dtype)
        how = "clipping searched" if search else "min-max"
        print(f"| {bits} bits, {how} | {agreement(draft, sequences):.1%} |", flush=True)


if __name__ == "__main__":
    main()

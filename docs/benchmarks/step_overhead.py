"""Framework overhead of one decode step: the same engine loop on a model too small for the math to matter.

Run from the repository root: python docs/benchmarks/step_overhead.py

A Qwen2-shaped model with the default target's 28 layers but hidden size 64 and a 256-token vocabulary makes
every matmul trivial, so a step's time is what Python and PyTorch's per-op dispatch cost, per step and per
layer.
"""

from __future__ import annotations

import time

import torch

from specdecode.models.decoder.packed_linear import can_pack, pack_linears
from specdecode.models.decoder.transformer import Transformer
from specdecode.models.model_config import ModelConfig

LAYERS = 28


def tiny_model(dtype: torch.dtype) -> Transformer:
    config = ModelConfig(architecture="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_layers=LAYERS, num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True)
    torch.manual_seed(0)
    model = Transformer(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.05)
    model = model.to(dtype)
    model.finish_loading()
    if can_pack(model):  # as the loader does for bf16 on CPU
        pack_linears(model)
    return model.eval()


@torch.inference_mode()
def forward_ms(model: Transformer, steps: int = 200) -> float:
    cache = model.new_cache(steps + 64)
    model(torch.arange(32).unsqueeze(0), torch.arange(32).unsqueeze(0), cache)
    start = time.perf_counter()
    for position in range(32, 32 + steps):
        model(torch.tensor([[7]]), torch.tensor([[position]]), cache)
    return (time.perf_counter() - start) / steps * 1000


def main() -> None:
    print(f"{torch.get_num_threads()} threads, {LAYERS} layers")
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_model(dtype)
        forward = forward_ms(model)
        print(f"{str(dtype)[6:]:>8}: {forward:.2f} ms per decode step, {forward / LAYERS * 1000:.0f} us per layer")


if __name__ == "__main__":
    main()

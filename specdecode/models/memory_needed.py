"""How much memory a model's weights take once loaded, said before loading: a mixture of experts holds every
expert in memory while a token reads only k of them, so a 30B-A3B model is a 30B model to load. Counted from the
config's sizes (families' parameter_count, every expert included) at the bytes a weight takes in the dtype or
quantization asked for; a model that cannot fit in the memory this machine has free is refused with the numbers."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from specdecode.errors import SpecDecodeError
from specdecode.models.model_config import ModelConfig
from specdecode.models.model_files import parameter_count

# Bytes a linear layer's weight takes in each quantization: int4 and w4a8 codes with a scale and offset per group of
# 32 (4.625 bits), w3a8 3.625 bits (quantized_model.py); the norms and the embedding stay in the float dtype, a
# few percent of a large model, so this is a lower bound.
_QUANT_BYTES = {"int8": 1.0, "int4": 4.625 / 8, "w4a8": 4.625 / 8, "w3a8": 3.625 / 8}
_GIB = 1 << 30


def expert_parameters(config: ModelConfig) -> int:
    """Weights held in routed experts (all layers and MTP modules): 3 matrices of hidden x expert size each."""
    moe = config.moe
    if moe is None:
        return 0
    sparse_layers = config.num_layers - len(moe.dense_layers) + config.mtp_layers
    return sparse_layers * moe.num_experts * 3 * config.hidden_size * moe.expert_size


def weights_bytes(config: ModelConfig, dtype: torch.dtype, quant: str) -> int:
    per_weight = _QUANT_BYTES.get(quant, dtype.itemsize)
    return int(parameter_count(config) * per_weight)


def count(weights: int) -> str:
    """A number of weights as people write it: 30.53B, 1.54M."""
    return f"{weights / 1e9:.2f}B" if weights >= 10**8 else f"{weights / 1e6:.2f}M"


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_memory(config: ModelConfig, dtype: torch.dtype, quant: str, where: str, quiet: bool) -> None:
    """Say what a mixture of experts needs (unless quiet), and refuse any model whose weights cannot fit."""
    needed = weights_bytes(config, dtype, quant)
    kind = quant if quant != "none" else str(dtype).removeprefix("torch.")
    total, experts = parameter_count(config), expert_parameters(config)
    if experts and not quiet:
        moe = config.moe
        active = total - experts + experts * moe.experts_per_token // moe.num_experts
        print(f"{where}: {count(total)} weights, {count(experts)} of them in {moe.num_experts} experts a layer "
              f"({count(active)} read per token): about {needed / _GIB:.1f} GiB in {kind}", file=sys.stderr)
    free = available_bytes()
    if free is not None and needed > free:
        raise SpecDecodeError(f"{where} needs about {needed / _GIB:.1f} GiB for its {count(total)} weights in "
                              f"{kind}, and this machine has {free / _GIB:.1f} GiB free; try a smaller --quant "
                              "(w4a8) or a smaller model")

"""Tiny Qwen 3.5 (hybrid) checkpoints for tests, written by transformers itself, with the MTP module its released
checkpoints ship (top-level mtp.* tensors, which transformers' Qwen3_5ForCausalLM does not save)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

MTP_NORMS = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")


def mtp_tensors(config: dict, seed: int = 0, scale: float = 0.3, follow: float = 0.0) -> dict[str, torch.Tensor]:
    """A random MTP module in Qwen 3.5's layout: mtp.fc over [embedding ; hidden], zero-centred norms, one gated
    full-attention block. follow > 0 adds follow * identity on the hidden half of fc and shrinks the block, so it
    mostly repeats the trunk's prediction (drafts the target sometimes accepts)."""
    generator = torch.Generator().manual_seed(seed)
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    head = config["head_dim"]
    q, kv = config["num_attention_heads"] * head, config["num_key_value_heads"] * head
    block = scale * (0.2 if follow else 1.0)

    def random(*shape: int, spread: float = block) -> torch.Tensor:
        if len(shape) == 1:
            return 0.2 * torch.randn(shape, generator=generator)  # zero-centred: near 0 is near identity
        return torch.randn(shape, generator=generator) * spread

    layer = {"input_layernorm.weight": random(hidden), "post_attention_layernorm.weight": random(hidden),
             "self_attn.q_proj.weight": random(2 * q, hidden), "self_attn.k_proj.weight": random(kv, hidden),
             "self_attn.v_proj.weight": random(kv, hidden), "self_attn.o_proj.weight": random(hidden, q),
             "self_attn.q_norm.weight": random(head), "self_attn.k_norm.weight": random(head),
             "mlp.gate_proj.weight": random(inner, hidden), "mlp.up_proj.weight": random(inner, hidden),
             "mlp.down_proj.weight": random(hidden, inner)}
    tensors = {f"mtp.layers.0.{name}": value for name, value in layer.items()}
    tensors.update({f"mtp.{norm}.weight": random(hidden) for norm in MTP_NORMS})
    fc = random(hidden, 2 * hidden)
    fc[:, hidden:] += follow * torch.eye(hidden)  # the hidden half: [embedding ; hidden]
    tensors["mtp.fc.weight"] = fc
    return tensors


def add_hybrid_mtp(folder: Path, seed: int = 0, scale: float = 0.3, follow: float = 0.0) -> dict[str, torch.Tensor]:
    """Write an MTP module into model-mtp.safetensors beside a tiny Qwen 3.5 and declare it -> its tensors."""
    config = json.loads((folder / "config.json").read_text())
    tensors = mtp_tensors(config, seed, scale, follow)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model-mtp.safetensors"))
    config["mtp_num_hidden_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    return tensors

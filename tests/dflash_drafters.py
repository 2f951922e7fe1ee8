"""Random DFlash and DSpark drafters for tiny test targets, written in z-lab's and DeepSpec's layouts by our
writers (the DFlash layout is checked against the authors' code in test_dflash.py, DSpark's names in
test_dspark.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from specdecode.models.formats.dflash import save_dflash
from specdecode.models.formats.dspark import save_dspark
from specdecode.models.heads.dflash import DFlashConfig, DFlashModel
from specdecode.models.heads.dspark import DSparkHeads, DSparkModel
from specdecode.models.loader import LoadedModel
from specdecode.models.model_config import ModelConfig


def write_random_dflash(folder: Path, target: LoadedModel, layers: int = 1, block: int = 4, seed: int = 0,
                        scale: float = 0.3, favour: int | None = None) -> Path:
    """A DFlash drafter for `target` reading its layers 0 and L-1 (output-of-layer ids), random weights.

    favour: a token the drafter leans to in every slot, through its output projection's bias (random drafters
    over 272 tokens are never accepted; the token the target emits most is then accepted often, not always)."""
    config = _config(target, layers, block)
    model = DFlashModel(config, target.model.embed, target.model.lm_head)
    _randomize(model, target, seed, scale, favour)
    return save_dflash(model, folder, target.config)


def write_random_dspark(folder: Path, target: LoadedModel, heads: DSparkHeads = DSparkHeads(markov_rank=8),
                        layers: int = 1, block: int = 4, seed: int = 0, scale: float = 0.3,
                        favour: int | None = None, confidence_bias: float = 0.0) -> Path:
    """A DSpark drafter for `target`, random weights as write_random_dflash's, with `heads`; confidence_bias
    shifts every slot's confidence logit (large: never cut, very negative: always cut)."""
    model = DSparkModel(_config(target, layers, block), heads, target.model.embed, target.model.lm_head)
    _randomize(model, target, seed, scale, favour)
    if model.confidence_head is not None:
        with torch.no_grad():
            model.confidence_head.proj.bias.add_(confidence_bias)
    return save_dspark(model, folder, target.config, anchors=16)


def _config(target: LoadedModel, layers: int, block: int) -> DFlashConfig:
    tc = target.config
    layer = ModelConfig(architecture="qwen3", vocab_size=tc.vocab_size, hidden_size=tc.hidden_size,
                        intermediate_size=tc.intermediate_size, num_layers=layers, num_heads=tc.num_heads,
                        num_kv_heads=tc.num_kv_heads, head_dim=tc.head_dim, rms_norm_eps=tc.rms_norm_eps,
                        rope_theta=tc.rope_theta, max_position_embeddings=tc.max_position_embeddings, qk_norm=True,
                        qkv_bias=True, o_bias=True)
    return DFlashConfig(layer=layer, target_layer_ids=(0, tc.num_layers - 1), block_size=block,
                        mask_token_id=tc.vocab_size - 1, target_hidden_size=tc.hidden_size,
                        causal_layers=(False,) * layers, windows=(None,) * layers)


def _randomize(model: DFlashModel, target: LoadedModel, seed: int, scale: float, favour: int | None) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            shape = param.shape
            param.copy_(torch.randn(shape, generator=generator) * scale if param.dim() > 1
                        else 0.8 + 0.4 * torch.rand(shape, generator=generator))
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
        if favour is not None:
            row = target.model.output_rows(torch.tensor([favour]))[0]  # [H]
            model.layers[-1].o.bias.add_(3.0 * row / row.pow(2).mean().sqrt())

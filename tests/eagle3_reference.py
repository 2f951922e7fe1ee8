"""Test-side EAGLE-3 code written from the published descriptions, independent of specdecode's head: random
checkpoints in each published layout (reference, speculators, SpecForge/SGLang) and a plain re-implementation of
the published forward over the published tensor names (SafeAILab/EAGLE@cb7e084 eagle/model/cnets.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

LAYOUTS = ("reference", "speculators", "specforge")


def random_head(target_hidden: int, vocab: int, hidden: int | None = None, heads: int = 4, kv_heads: int = 2,
                intermediate: int = 96, draft_vocab: int | None = None, draft_ids: list[int] | None = None,
                n_aux: int = 3, seed: int = 0, scale: float = 0.2, own_embedding: bool = False) -> dict:
    """Published tensor names (reference layout: `midlayer.*`) -> random weights. `draft_ids` (ascending target
    ids) makes a reduced draft vocabulary with its d2t offsets and t2d mask, as the reference builds them."""
    generator = torch.Generator().manual_seed(seed)
    hidden = hidden or target_hidden

    def rand(*shape):
        return torch.randn(*shape, generator=generator) * scale

    def norm(size):
        return 0.8 + 0.4 * torch.rand(size, generator=generator)

    head_dim = hidden // heads
    weights = {
        "fc.weight": rand(hidden, n_aux * target_hidden),
        "midlayer.hidden_norm.weight": norm(hidden), "midlayer.input_layernorm.weight": norm(hidden),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        "midlayer.post_attention_layernorm.weight": norm(hidden),
        "midlayer.mlp.gate_proj.weight": rand(intermediate, hidden),
        "midlayer.mlp.up_proj.weight": rand(intermediate, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, intermediate),
        "norm.weight": norm(hidden),
    }
    if draft_ids is not None:
        weights["lm_head.weight"] = rand(len(draft_ids), hidden) * 5
        weights["d2t"] = torch.tensor(draft_ids) - torch.arange(len(draft_ids))
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[draft_ids] = True
        weights["t2d"] = t2d
    else:
        weights["lm_head.weight"] = rand(draft_vocab or vocab, hidden) * 5
    if own_embedding:
        weights["embed_tokens.weight"] = rand(vocab, hidden) * 5
    return weights


def head_config(weights: dict, vocab: int, layout: str, layer_ids: list[int] | None = None,
                rope_theta: float = 10000.0, **extra) -> dict:
    hidden = weights["fc.weight"].shape[0]
    layer = {"model_type": "llama", "hidden_size": hidden, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": weights["midlayer.mlp.gate_proj.weight"].shape[0], "num_hidden_layers": 1,
             "rms_norm_eps": 1e-5, "rope_theta": rope_theta, "vocab_size": vocab, "max_position_embeddings": 2048}
    draft_vocab = weights["lm_head.weight"].shape[0]
    if layout == "reference":
        return {"architectures": ["LlamaForCausalLMEagle3"], **layer, "draft_vocab_size": draft_vocab, **extra}
    if layout == "speculators":
        return {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                "transformer_layer_config": layer, "draft_vocab_size": draft_vocab,
                "target_hidden_size": weights["fc.weight"].shape[1] // 3, "norm_before_residual": False,
                "eagle_aux_hidden_state_layer_ids": layer_ids,
                "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy"}, **extra}
    if layout == "specforge":  # SpecForge writes "output of layer k" ids, nested
        return {"architectures": ["LlamaForCausalLMEagle3"], **layer, "draft_vocab_size": draft_vocab,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layer_ids],
                                 "use_aux_hidden_state": True}, **extra}
    raise ValueError(layout)


def write_head(folder: Path, weights: dict, config: dict, layout: str) -> Path:
    """Save in `layout`'s tensor names: speculators renames `midlayer.` to `layers.0.`; SGLang-trained heads
    often carry a `model.` prefix."""
    folder.mkdir(parents=True, exist_ok=True)
    if layout == "speculators":
        weights = {name.replace("midlayer.", "layers.0."): t for name, t in weights.items()}
    elif layout == "specforge":
        weights = {(name if name in ("lm_head.weight", "d2t", "t2d") else "model." + name): t
                   for name, t in weights.items()}
    save_file({name: t.clone().contiguous() for name, t in weights.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [heads, T, D], HF's rotate_half convention."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angles = torch.outer(positions.double(), inv_freq)  # [T, D/2]
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().float(), emb.sin().float()
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class ReferenceHead:
    """The published forward, step by step, with a growing K/V list (rows are causal: each sees all before)."""

    def __init__(self, weights: dict, embed: torch.Tensor, heads: int = 4, kv_heads: int = 2, eps: float = 1e-5,
                 theta: float = 10000.0, norm_before_residual: bool = False):
        self.w = {name.removeprefix("model.").replace("layers.0.", "midlayer."): t.float() for name, t in weights.items()}
        self.embed = self.w.get("embed_tokens.weight", embed)
        self.heads, self.kv_heads, self.eps, self.theta = heads, kv_heads, eps, theta
        self.norm_before_residual = norm_before_residual
        self.keys: list[torch.Tensor] = []  # [kv_heads, 1, D] per row
        self.values: list[torch.Tensor] = []
        self.positions: list[int] = []

    def fuse(self, states: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(states, dim=-1) @ self.w["fc.weight"].T

    def step(self, tokens: list[int], hidden: torch.Tensor, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows in order (each attends to every earlier row and itself) -> (logits [T, Vd], out [T, H])."""
        w, layer = self.w, "midlayer."
        u = torch.cat([_rms(self.embed[tokens], w[layer + "input_layernorm.weight"], self.eps),
                       _rms(hidden, w[layer + "hidden_norm.weight"], self.eps)], dim=-1)  # [T, 2H]
        count = len(tokens)
        q = (u @ w[layer + "self_attn.q_proj.weight"].T).view(count, self.heads, -1).transpose(0, 1)
        k = (u @ w[layer + "self_attn.k_proj.weight"].T).view(count, self.kv_heads, -1).transpose(0, 1)
        v = (u @ w[layer + "self_attn.v_proj.weight"].T).view(count, self.kv_heads, -1).transpose(0, 1)
        if layer + "self_attn.q_norm.weight" in w:  # a Qwen3-typed layer: RMSNorm per head before rope
            q = _rms(q, w[layer + "self_attn.q_norm.weight"], self.eps)
            k = _rms(k, w[layer + "self_attn.k_norm.weight"], self.eps)
        pos = torch.tensor(positions)
        q, k = _rope(q, pos, self.theta), _rope(k, pos, self.theta)
        past = len(self.keys)
        for row in range(count):
            self.keys.append(k[:, row : row + 1])
            self.values.append(v[:, row : row + 1])
        keys = torch.cat(self.keys, dim=1).repeat_interleave(self.heads // self.kv_heads, dim=0)  # [heads, S, D]
        values = torch.cat(self.values, dim=1).repeat_interleave(self.heads // self.kv_heads, dim=0)
        scores = q @ keys.transpose(1, 2) / math.sqrt(q.shape[-1])  # [heads, T, S]
        visible = torch.arange(keys.shape[1]).view(1, -1) <= (past + torch.arange(count)).view(-1, 1)
        attn = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ values  # [heads, T, D]
        attn = attn.transpose(0, 1).reshape(count, -1) @ w[layer + "self_attn.o_proj.weight"].T
        residual = _rms(hidden, w[layer + "hidden_norm.weight"], self.eps) if self.norm_before_residual else hidden
        a = residual + attn
        normed = _rms(a, w[layer + "post_attention_layernorm.weight"], self.eps)
        mlp = (torch.nn.functional.silu(normed @ w[layer + "mlp.gate_proj.weight"].T)
               * (normed @ w[layer + "mlp.up_proj.weight"].T)) @ w[layer + "mlp.down_proj.weight"].T
        out = a + mlp
        logits = _rms(out, w["norm.weight"], self.eps) @ w["lm_head.weight"].T
        return logits, out

    def target_id(self, draft_id: int) -> int:
        d2t = self.w.get("d2t")
        return draft_id if d2t is None else draft_id + int(d2t[draft_id])

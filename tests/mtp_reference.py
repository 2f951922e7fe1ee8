"""MTP layers for tiny test models, in each published naming, and the published forward written plainly.

The reference follows the equations vLLM and SGLang implement (../shared/notes/drafter-formats.md section 2):
DeepSeek / GLM concatenate [enorm(embedding); hnorm(hidden)], MiMo [hidden_layernorm(hidden);
token_layernorm(embedding)]; the block is the trunk family's own Hugging Face decoder layer; logits come from
the trunk's head after the module's final norm.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

# Our part -> its name in each layout (after the layout's prefix), as the checkpoints ship them.
NAMES = {
    "deepseek": {"token_norm": "enorm", "hidden_norm": "hnorm", "proj": "eh_proj", "out_norm": "shared_head.norm"},
    "mimo": {"token_norm": "token_layernorm", "hidden_norm": "hidden_layernorm", "proj": "input_proj",
             "out_norm": "final_layernorm"},
}
BLOCK_SHAPES = {
    "input_layernorm.weight": ("H",), "post_attention_layernorm.weight": ("H",),
    "self_attn.q_proj.weight": ("Q", "H"), "self_attn.k_proj.weight": ("KV", "H"),
    "self_attn.v_proj.weight": ("KV", "H"), "self_attn.o_proj.weight": ("H", "Q"),
    "mlp.gate_proj.weight": ("I", "H"), "mlp.up_proj.weight": ("I", "H"), "mlp.down_proj.weight": ("H", "I"),
}
BIASES = {"self_attn.q_proj.bias": ("Q",), "self_attn.k_proj.bias": ("KV",), "self_attn.v_proj.bias": ("KV",)}
QK_NORMS = {"self_attn.q_norm.weight": ("D",), "self_attn.k_norm.weight": ("D",)}  # Qwen3


def prefix(layout: str, j: int, trunk_layers: int) -> str:
    return f"model.mtp_layers.{j}." if layout == "mimo" else f"model.layers.{trunk_layers + j}."


def add_mtp_layers(folder: Path, layout: str, modules: int = 1, seed: int = 0, scale: float = 0.3,
                   follow: float = 0.0, shared_copies: bool = False) -> dict[str, torch.Tensor]:
    """Write `modules` random MTP modules for the model in `folder` into model-mtp.safetensors (a second
    file, as sharded checkpoints have) and declare them in config.json -> the tensors written.

    follow > 0 adds follow * identity on the hidden half of the projection and shrinks the block, so the module
    mostly repeats the trunk's own prediction (drafts the target sometimes accepts); shared_copies writes the
    DeepSeek layout's copies of the embedding and head too."""
    config = json.loads((folder / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    sizes = {"H": config["hidden_size"], "I": config["intermediate_size"], "D": head_dim,
             "Q": config["num_attention_heads"] * head_dim, "KV": config["num_key_value_heads"] * head_dim}
    hidden, trunk = sizes["H"], config["num_hidden_layers"]
    generator = torch.Generator().manual_seed(seed)
    block_scale = scale * (0.2 if follow else 1.0)

    def random(shape: tuple[int, ...], spread: float) -> torch.Tensor:
        if len(shape) == 1:
            return 0.8 + 0.4 * torch.rand(shape, generator=generator)
        return torch.randn(shape, generator=generator) * spread

    tensors = {}
    for j in range(modules):
        start = prefix(layout, j, trunk)
        parts = dict(BLOCK_SHAPES, **(BIASES if config["model_type"] in ("qwen2", "mimo") else {}),
                     **(QK_NORMS if config["model_type"] == "qwen3" else {}))
        for name, dims in parts.items():
            tensors[start + name] = random(tuple(sizes[d] for d in dims), block_scale)
        names = NAMES[layout]
        for norm in ("token_norm", "hidden_norm", "out_norm"):
            tensors[f"{start}{names[norm]}.weight"] = random((hidden,), scale)
        proj = random((hidden, 2 * hidden), block_scale)
        hidden_half = slice(0, hidden) if layout == "mimo" else slice(hidden, 2 * hidden)
        proj[:, hidden_half] += follow * torch.eye(hidden)
        tensors[f"{start}{names['proj']}.weight"] = proj
        if shared_copies:
            trunk_weights = _trunk_tensors(folder)
            tensors[start + "embed_tokens.weight"] = trunk_weights["model.embed_tokens.weight"]
            tensors[start + "shared_head.head.weight"] = trunk_weights["lm_head.weight"]
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model-mtp.safetensors"))
    config["num_nextn_predict_layers"] = modules
    if layout == "mimo":
        config["model_type"], config["architectures"] = "mimo", ["MiMoForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    return tensors


def _trunk_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def reference_logits(hf_model, tensors: dict[str, torch.Tensor], layout: str, tokens: list[int]) -> torch.Tensor:
    """Module 0 of `tensors` over a sequence, as published: row i reads the trunk's final (post-norm) hidden
    state of token i and the embedding of token i+1 -> logits [T-1, V] float32 (predicting token i+2)."""
    config = hf_model.config
    start = prefix(layout, 0, config.num_hidden_layers)
    names = NAMES[layout]
    ids = torch.tensor([tokens])
    with torch.no_grad():
        trunk = hf_model(ids, output_hidden_states=True)
        final = trunk.hidden_states[-1][:, :-1]  # [1, T-1, H]: after the final norm, as lm_head reads it
        embeds = hf_model.model.embed_tokens(ids[:, 1:])  # [1, T-1, H]
        eps = config.rms_norm_eps

        def norm(x: torch.Tensor, part: str) -> torch.Tensor:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * tensors[f"{start}{names[part]}.weight"]

        pair = [norm(embeds, "token_norm"), norm(final, "hidden_norm")]
        joined = torch.cat(pair[::-1] if layout == "mimo" else pair, dim=-1)  # [1, T-1, 2H]
        u = joined @ tensors[f"{start}{names['proj']}.weight"].T  # [1, T-1, H]
        block = type(hf_model.model.layers[0])(config, layer_idx=0)
        block.load_state_dict({k.removeprefix(start): v for k, v in tensors.items()
                               if k.startswith(start) and k.removeprefix(start) in block.state_dict()})
        positions = torch.arange(len(tokens) - 1).unsqueeze(0)  # [1, T-1]: the hidden states' positions
        rope = hf_model.model.rotary_emb(u, positions)
        y = block(u, position_ids=positions, position_embeddings=rope)  # [1, T-1, H]
        y = y[0] if isinstance(y, tuple) else y
        return hf_model.lm_head(norm(y, "out_norm"))[0].float()  # [T-1, V]

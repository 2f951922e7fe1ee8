"""llama.cpp's `deepseek2` GGUF files (DeepSeek-V2/V3, Kimi K2, and GLM-4.7-Flash, which its converter writes as
deepseek2 too): the Llama-style and mixture-of-experts names (formats/gguf_names.py) plus latent attention's, and
kv_b_proj, which the converter splits per head into `attn_k_b` (ggml {nope, C, nh}: each head's key half,
transposed) and `attn_v_b` (ggml {C, v, nh}), joined back here. Files from before that split hold `attn_kv_b`
whole and read as it is. Sources: llama.cpp conversion/deepseek.py (DeepseekV2Model.modify_tensors) and
gguf-py's tensor names (constants.py MODEL_TENSORS[DEEPSEEK2]); the README gathers them."""

from __future__ import annotations

import torch

from specdecode.models.formats.gguf_layout import GGUFLayout
from specdecode.models.formats.gguf_names import MOE_BLOCK_NAMES, llama_style_name

LATENT_BLOCK_NAMES = MOE_BLOCK_NAMES | {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    # the two halves of kv_b_proj, under gguf-py's names for them (tensor_mapping.py: k_b_proj, v_b_proj)
    "attn_k_b": "self_attn.k_b_proj",
    "attn_v_b": "self_attn.v_b_proj",
}
_KEY_HALF, _VALUE_HALF, _WHOLE = "self_attn.k_b_proj.weight", "self_attn.v_b_proj.weight", "self_attn.kv_b_proj.weight"


def latent_name(gguf_name: str) -> str:
    """A deepseek2 tensor's name -> Hugging Face's."""
    return llama_style_name(gguf_name, LATENT_BLOCK_NAMES)


class LatentLayout(GGUFLayout):
    def __init__(self):
        # Rows stay in Hugging Face's order: llama.cpp rotates deepseek2's rotary dims as neighbouring pairs
        # (rope type NORM), which is DeepSeek's rope_interleave, so nothing is permuted.
        super().__init__(latent_name)

    def joined(self, names: set[str]) -> dict[str, tuple[str, ...]]:
        return {name.replace(_KEY_HALF, _WHOLE): (name, name.replace(_KEY_HALF, _VALUE_HALF))
                for name in names if name.endswith(_KEY_HALF) and name.replace(_KEY_HALF, _VALUE_HALF) in names}

    def join(self, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
        key_half, value_half = parts  # [nh, C, nope] (stored transposed) and [nh, v, C]
        per_head = torch.cat([key_half.transpose(1, 2), value_half], dim=1)  # [nh, nope + v, C]: keys, then values
        return per_head.reshape(-1, per_head.shape[-1]).contiguous()  # [nh * (nope + v), C], as kv_b_proj

"""llama.cpp's names for the tensors of a Llama-style model (the `llama`, `qwen2` and `qwen3` architectures, and the
attention of others), with its multi-token-prediction ("nextn") tensors in DeepSeek's layout, read back as the
Hugging Face names they were converted from."""

from __future__ import annotations

import re

from specdecode.errors import SpecDecodeError

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",  # llama3 rope scaling factors; our loader reads them, transformers ignores them
}
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# A mixture of experts' tensors (qwen3moe, glm4moe, ...): the router and the experts stacked in one tensor each,
# read as one tensor per expert (formats/weight_source.py fills in the expert's index).
MOE_BLOCK_NAMES = BLOCK_NAMES | {
    "post_attention_norm": "post_attention_layernorm",  # glm4moe's and qwen35moe's name for the MLP's norm
    "ffn_gate_inp": "mlp.gate",
    "exp_probs_b": "mlp.gate.e_score_correction",  # the router's selection bias, stored as `exp_probs_b.bias`
    "ffn_gate_exps": "mlp.experts.{expert}.gate_proj",
    "ffn_up_exps": "mlp.experts.{expert}.up_proj",
    "ffn_down_exps": "mlp.experts.{expert}.down_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
_BLOCK_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# llama.cpp's multi-token-prediction ("nextn") tensors: gguf-py's names for DeepSeek's, in the last
# `{arch}.nextn_predict_layers` blocks, whose other tensors are an ordinary decoder layer (decoder/mtp.py).
NEXTN_NAMES = {"eh_proj": "eh_proj", "enorm": "enorm", "hnorm": "hnorm", "shared_head_norm": "shared_head.norm",
               "shared_head_head": "shared_head.head", "embed_tokens": "embed_tokens"}
_NEXTN_PATTERN = re.compile(r"blk\.(\d+)\.nextn\.(\w+)\.weight")


def llama_style_name(gguf_name: str, blocks: dict[str, str] = BLOCK_NAMES) -> str:
    """A tensor's name in the file -> its Hugging Face name; `blocks` maps a block tensor's llama.cpp name (without
    `.weight`) to Hugging Face's, for families that add their own."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    nextn = _NEXTN_PATTERN.fullmatch(gguf_name)
    if nextn is not None and nextn.group(2) in NEXTN_NAMES:
        return f"model.layers.{nextn.group(1)}.{NEXTN_NAMES[nextn.group(2)]}.weight"
    match = _BLOCK_PATTERN.fullmatch(gguf_name)
    if match is None or match.group(2) not in blocks:
        raise SpecDecodeError(f"unsupported tensor {gguf_name!r} in GGUF file")
    block, part, kind = match.groups()
    name = f"model.layers.{block}.{blocks[part]}.{kind}"
    return name.replace("e_score_correction.bias", "e_score_correction_bias")  # Hugging Face's one-word name

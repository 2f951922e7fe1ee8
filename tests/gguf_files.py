"""GGUF files for tests, written the way llama.cpp's converter writes them (gguf-py's own writer and quantizers).

gguf-py cannot quantize to K-quants, so Q4_K and Q6_K tensors are random but valid blocks: the file then
defines the model, and tests compare our loads against gguf-py's own dequantization of it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
from conftest import CHAT_TEMPLATE, TINY_VOCAB, byte_tokenizer
from safetensors import safe_open

Q8_0, F16, F32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32
Q4_K, Q6_K, Q5_0 = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K, gguf.GGMLQuantizationType.Q5_0

# Hugging Face name (after "model.layers.N.") -> GGUF name and the type we store it as: a realistic mix of
# lossy Q8_0 and lossless F16/F32, as llama.cpp's converter writes (norms and biases stay F32).
_BLOCK = {
    "input_layernorm.weight": ("attn_norm.weight", F32),
    "self_attn.q_proj.weight": ("attn_q.weight", F16),
    "self_attn.k_proj.weight": ("attn_k.weight", Q8_0),
    "self_attn.v_proj.weight": ("attn_v.weight", Q8_0),
    "self_attn.q_proj.bias": ("attn_q.bias", F32),
    "self_attn.k_proj.bias": ("attn_k.bias", F32),
    "self_attn.v_proj.bias": ("attn_v.bias", F32),
    "self_attn.o_proj.weight": ("attn_output.weight", F16),
    "post_attention_layernorm.weight": ("ffn_norm.weight", F32),
    "mlp.gate_proj.weight": ("ffn_gate.weight", Q8_0),
    "mlp.up_proj.weight": ("ffn_up.weight", F16),
    "mlp.down_proj.weight": ("ffn_down.weight", Q8_0),
}
# DeepSeek-named MTP parts (after "model.layers.N.") -> llama.cpp's nextn tensors (gguf-py's MODEL_TENSOR.NEXTN_*).
_NEXTN = {
    "eh_proj.weight": ("nextn.eh_proj.weight", F16),
    "enorm.weight": ("nextn.enorm.weight", F32),
    "hnorm.weight": ("nextn.hnorm.weight", F32),
    "shared_head.norm.weight": ("nextn.shared_head_norm.weight", F32),
    "shared_head.head.weight": ("nextn.shared_head_head.weight", F16),
    "embed_tokens.weight": ("nextn.embed_tokens.weight", Q8_0),
}
_GLOBAL = {
    "model.embed_tokens.weight": ("token_embd.weight", Q8_0),
    "model.norm.weight": ("output_norm.weight", F32),
    "lm_head.weight": ("output.weight", F16),
}


def llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """What convert_hf_to_gguf.py does to llama q/k rows (LlamaModel.permute): interleave the rotary halves."""
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def llama3_rope_factors(scaling: dict, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs tensor for llama3 scaling (transformers 5's rope_parameters)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    factors = []
    for freq in 1.0 / (scaling["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def hf_weights(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of the folder's safetensors files (MTP layers may sit in a second one)."""
    weights = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:  # numpy has no bfloat16
            weights.update({key: handle.get_tensor(key).float().numpy() for key in handle.keys()})
    return weights


def gguf_tokens(size: int = TINY_VOCAB) -> tuple[list[str], list[int], list[str]]:
    """The conftest byte vocabulary (same ids) plus two merges, padded to the embedding's `size` like Qwen's
    files."""
    vocab = byte_tokenizer().get_vocab()
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    types = [int(gguf.TokenType.CONTROL if token.startswith("<|") else gguf.TokenType.NORMAL) for token in tokens]
    merges = ["Ġ t", "h e"]
    for merged in ("Ġt", "he"):
        tokens.append(merged)
        types.append(int(gguf.TokenType.NORMAL))
    while len(tokens) < size:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(int(gguf.TokenType.UNUSED))
    return tokens, types, merges


def add_vocabulary(writer: gguf.GGUFWriter, size: int, pre: str) -> None:
    """gguf_tokens' byte vocabulary as a "gpt2" tokenizer, its chat template, and <|endoftext|> as BOS and EOS
    (like Qwen's files: <|im_end|> must come from the vocabulary)."""
    tokens, types, merges = gguf_tokens(size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|endoftext|>"))
    writer.add_chat_template(CHAT_TEMPLATE)


def write_gguf(path: Path, hf_folder: Path, arch: str, quantized: bool = True,
               rope_factors: np.ndarray | None = None,
               qtypes: dict[str, gguf.GGMLQuantizationType] | None = None, part: str = "all",
               ) -> dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]:
    """Writes `hf_folder`'s model as a GGUF file the way llama.cpp's converter would.

    part: "all"; "trunk" as its --no-mtp writes (block_count L, no nextn key, no MTP blocks); "mtp" as its --mtp
    writes a companion (block_count L+n, the nextn key, only the MTP blocks and the embedding, norm and head).

    qtypes: GGUF name (e.g. "blk.0.ffn_down.weight", or "ffn_down.weight" for every block) -> the type to store
    it as, instead of the default mix; Q4_K and Q6_K tensors become random valid blocks (see the module doc).
    Returns HF name -> (the array stored in the file, its type), to check the conversion against.
    """
    config = json.loads((hf_folder / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    # llama.cpp counts MTP ("nextn") blocks in block_count, after the trunk's.
    nextn = config.get("num_nextn_predict_layers", 0)
    trunk = config["num_hidden_layers"]
    if part == "trunk":
        nextn = 0
    writer.add_block_count(trunk + nextn)
    if nextn:
        writer.add_nextn_predict_layers(nextn)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    add_vocabulary(writer, TINY_VOCAB, "qwen2" if arch == "qwen2" else "llama-bpe")

    stored = {}
    for name, weight in hf_weights(hf_folder).items():
        block = int(name.split(".")[2]) if name not in _GLOBAL else None
        if block is not None and (block < trunk if part == "mtp" else block >= trunk + nextn):
            continue
        if name in _GLOBAL:
            gguf_name, qtype = _GLOBAL[name]
        else:
            _, _, block, rest = name.split(".", 3)
            gguf_name, qtype = _NEXTN[rest] if rest in _NEXTN else _BLOCK[rest]
            gguf_name = f"blk.{block}.{gguf_name}"
        if arch == "llama" and ".attn_q." in gguf_name:
            weight = llama_cpp_permute(weight, heads)
        elif arch == "llama" and ".attn_k." in gguf_name:
            weight = llama_cpp_permute(weight, kv_heads)
        if qtypes:
            qtype = qtypes.get(gguf_name, qtypes.get(gguf_name.split(".", 2)[-1], qtype))
        if not quantized or weight.ndim == 1:
            qtype = F32
        if qtype in (Q4_K, Q6_K):
            data = random_k_blocks(qtype, *weight.shape, seed=len(stored))
        else:
            data = gguf.quants.quantize(weight.astype(np.float32), qtype)
        writer.add_tensor(gguf_name, data, raw_dtype=qtype)
        stored[name] = (data, qtype)
    if rope_factors is not None:
        writer.add_tensor("rope_freqs.weight", rope_factors, raw_dtype=F32)
    finish(writer)
    return stored


def random_k_blocks(qtype: gguf.GGMLQuantizationType, rows: int, columns: int, seed: int = 0) -> np.ndarray:
    """Random valid Q4_K or Q6_K blocks [rows, bytes], scaled so weights stay within about +-0.5 like a model's."""
    rng = np.random.default_rng(seed)
    block_bytes = {Q4_K: 144, Q6_K: 210}[qtype]
    blocks = rng.integers(0, 256, size=(rows * columns // 256, block_bytes), dtype=np.uint8)  # [B, bytes]
    count = len(blocks)
    if qtype == Q4_K:  # f16 d and dmin lead; 6-bit scales reach 63 and codes 15
        blocks[:, 0:2] = rng.uniform(1e-4, 5e-4, (count, 1)).astype(np.float16).view(np.uint8)
        blocks[:, 2:4] = rng.uniform(1e-4, 5e-4, (count, 1)).astype(np.float16).view(np.uint8)
    else:  # Q6_K: f16 d trails; int8 scales reach 127 and centred codes 32
        blocks[:, 208:210] = rng.uniform(2e-5, 1e-4, (count, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


# A Qwen 3.5 block's Hugging Face names (after "model.layers.N." or "mtp.layers.J.") -> llama.cpp's qwen35 names.
_QWEN35_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight", "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight", "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias", "linear_attn.A_log": "ssm_a", "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight"}
# Qwen 3.5 MoE's (qwen35moe): the router, the shared expert and its gate (stored [H], squeezed from [1, H]); the
# experts go stacked into ffn_{gate,up,down}_exps
_QWEN35_MOE = {"mlp.gate.weight": "ffn_gate_inp.weight", "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
               "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
               "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
               "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight"}
_QWEN35_NEXTN = {"mtp.fc.weight": "nextn.eh_proj.weight", "mtp.pre_fc_norm_embedding.weight": "nextn.enorm.weight",
                 "mtp.pre_fc_norm_hidden.weight": "nextn.hnorm.weight", "mtp.norm.weight": "nextn.shared_head_norm.weight"}


def _tiled(weight: np.ndarray, config: dict, per_head: int, offset: int = 0, axis: int = 0) -> np.ndarray:
    """llama.cpp's V-head reorder (grouped -> tiled): the file's head j is HF head (j % Hk) * r + j // Hk, over the
    `per_head`-sized blocks from `offset` along `axis`."""
    key_heads, value_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    if key_heads == value_heads:
        return weight
    j = np.arange(value_heads)
    source = (j % key_heads) * (value_heads // key_heads) + j // key_heads
    index = np.concatenate([np.arange(offset), (offset + source[:, None] * per_head + np.arange(per_head)).ravel()])
    return np.take(weight, index, axis=axis)


def qwen35_stored(name: str, weight: np.ndarray, config: dict) -> np.ndarray:
    """What llama.cpp's converter stores for a Qwen 3.5 tensor: zero-centred norms as 1 + w (not the gated
    ssm_norm), A_log as -exp(A_log), conv1d squeezed, value heads tiled."""
    keys = 2 * config["linear_num_key_heads"] * config["linear_key_head_dim"]
    value_dim = config["linear_value_head_dim"]
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        weight = _tiled(weight, config, value_dim, offset=keys)
    elif name.endswith("in_proj_z.weight"):
        weight = _tiled(weight, config, value_dim)
    elif name.endswith(("in_proj_a.weight", "in_proj_b.weight", "dt_bias", "A_log")):
        weight = _tiled(weight, config, 1)
    elif name.endswith("out_proj.weight"):
        weight = _tiled(weight, config, value_dim, axis=1)
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return weight + 1.0
    if name.endswith("A_log"):
        return -np.exp(weight)
    if name.endswith("conv1d.weight"):
        return weight[:, 0]
    return weight


def write_qwen35_gguf(path: Path, hf_folder: Path, mtp: bool = True, matrices=F32, part: str = "all") -> None:
    """`hf_folder`'s Qwen 3.5 model as llama.cpp's converter writes it (architecture "qwen35", or "qwen35moe" for a
    mixture of experts, its experts stacked per layer and projection), float32, or its
    matrices in `matrices` (F16 for a file llama-quantize takes); mtp=False (or part "trunk") as its --no-mtp
    writes (no nextn key, no MTP block); part "mtp" as its --mtp writes a companion (block_count L+n, the nextn
    key, the MTP blocks with the embedding, final norm and head, no trunk block)."""
    config = json.loads((hf_folder / "config.json").read_text())
    trunk = config["num_hidden_layers"]
    nextn = config.get("mtp_num_hidden_layers", 0) if mtp and part != "trunk" else 0
    moe = "num_experts" in config  # Qwen 3.5 MoE: architecture qwen35moe
    arch = "qwen35moe" if moe else "qwen35"
    writer = gguf.GGUFWriter(str(path), arch)
    if moe:
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(trunk + nextn)
    if nextn:
        writer.add_nextn_predict_layers(nextn)
    if not moe:
        writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    rope = config["rope_parameters"]
    writer.add_rope_freq_base(rope["rope_theta"])
    rotary = int(config["head_dim"] * rope["partial_rotary_factor"])
    writer.add_rope_dimension_count(rotary)
    half = rotary // 2  # the multimodal rope's sections over the rotary pairs (text reads one position in all)
    writer.add_rope_dimension_sections([half - 2 * (half // 3), half // 3, half // 3, 0])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(config["linear_key_head_dim"])
    writer.add_ssm_group_count(config["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(config["linear_num_value_heads"])
    writer.add_ssm_inner_size(config["linear_num_value_heads"] * config["linear_value_head_dim"])
    interval = config.get("full_attention_interval", 4)
    kinds = config.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                          for i in range(trunk)]
    writer.add_uint32(f"{arch}.full_attention_interval", interval)
    # The test configs' layer kinds are not every-4th: the file names them, as newer conversions do.
    writer.add_array(f"{arch}.attention.recurrent_layers",
                     [kind == "linear_attention" for kind in kinds] + [False] * nextn)
    add_vocabulary(writer, config["vocab_size"], "qwen35")
    experts: dict[str, list[np.ndarray]] = {}  # a stacked tensor's name -> its experts' weights, in order
    for name, weight in hf_weights(hf_folder).items():
        if name in _GLOBAL:
            gguf_name = _GLOBAL[name][0]
        elif name in _QWEN35_NEXTN:
            if not nextn:
                continue
            gguf_name = f"blk.{trunk}.{_QWEN35_NEXTN[name]}"
        else:
            _, _, block, rest = name.split(".", 3)
            if name.startswith("mtp."):
                if not nextn:
                    continue
                block = str(trunk + int(block))
            elif part == "mtp":
                continue  # a companion holds no trunk block
            if rest.startswith("mlp.experts."):  # mlp.experts.{e}.{part}.weight, sorted by e below
                _, _, expert, projection, _ = rest.split(".")
                stacked = f"blk.{block}.ffn_{projection.removesuffix('_proj')}_exps.weight"
                experts.setdefault(stacked, []).append((int(expert), weight))
                continue
            gguf_name = f"blk.{block}.{(_QWEN35_BLOCK | _QWEN35_MOE)[rest]}"
        data = qwen35_stored(name, weight.astype(np.float32), config)
        if gguf_name.endswith("ffn_gate_inp_shexp.weight"):
            data = data[0]  # [1, H] -> [H], as the converter squeezes it
        add_float(writer, gguf_name, data, matrices if not gguf_name.endswith("conv1d.weight") else F32)
    for gguf_name, weights in experts.items():  # [E, rows, columns]
        stacked = np.stack([weight for _, weight in sorted(weights, key=lambda item: item[0])]).astype(np.float32)
        writer.add_tensor(gguf_name, stacked.astype(np.float16) if matrices == F16 else stacked,
                          raw_dtype=matrices)
    finish(writer)


def add_float(writer: gguf.GGUFWriter, name: str, data: np.ndarray, matrices=F32) -> None:
    """A float tensor as a converter stores it: matrices in `matrices` (F32 or F16), vectors in F32."""
    data = np.ascontiguousarray(data, dtype=np.float32)
    if data.ndim == 2 and matrices == F16:
        writer.add_tensor(name, data.astype(np.float16), raw_dtype=F16)
    else:
        writer.add_tensor(name, data, raw_dtype=F32)


def finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

"""llama.cpp's GGUF layout for Qwen 3.5 / 3.6, dense (`general.architecture` "qwen35") and MoE ("qwen35moe": the
router, experts stacked per layer and projection, the shared expert and its gate), read back into Hugging Face
names and values, so the rest of the loader (conversion, quantization, hybrid.py) sees what a folder holds.

What llama.cpp's converter (conversion/qwen.py) does, undone here:
- names: `attn_qkv`, `attn_gate`, `ssm_beta`, `ssm_alpha`, `ssm_conv1d`, `ssm_dt.bias`, `ssm_a`, `ssm_norm`,
  `ssm_out` for a Gated DeltaNet layer's in_proj_{qkv,z,b,a}, conv1d, dt_bias, A_log, norm and out_proj;
  `attn_q` keeps each head's [query | gate]; `post_attention_norm` is post_attention_layernorm; the MTP module
  is block L (the trunk's depth) with `nextn.{eh_proj, enorm, hnorm, shared_head_norm}` for mtp.{fc,
  pre_fc_norm_embedding, pre_fc_norm_hidden, norm} and the block's own tensors for mtp.layers.0;
- values: every zero-centred norm is stored as 1 + w (the gated `ssm_norm` is not zero-centred and is stored as
  is); A_log is stored as -exp(A_log); conv1d [C, 1, K] is squeezed to [C, K];
- order: with fewer key than value heads, value heads go from grouped to tiled order (GGUF head j is HF head
  (j % Hk) * r + j // Hk, r = Hv / Hk) in the value rows of attn_qkv, attn_gate's rows, ssm_alpha's and
  ssm_beta's rows, ssm_a, ssm_dt, the convolution's value channels and ssm_out's input columns.
Layer kinds come from `qwen35.attention.recurrent_layers` when the file has it, else from
`full_attention_interval` (every interval-th layer full attention), as llama.cpp's loader decides.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from specdecode.errors import SpecDecodeError
from specdecode.models.decoder.moe import MoEConfig
from specdecode.models.formats.gguf_layout import GGUFLayout
from specdecode.models.model_config import ModelConfig

ARCHITECTURE, MOE_ARCHITECTURE = "qwen35", "qwen35moe"
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_BLOCK = {"attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
          "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
          "ffn_down.weight": "mlp.down_proj.weight", "attn_q.weight": "self_attn.q_proj.weight",
          "attn_k.weight": "self_attn.k_proj.weight", "attn_v.weight": "self_attn.v_proj.weight",
          "attn_output.weight": "self_attn.o_proj.weight", "attn_q_norm.weight": "self_attn.q_norm.weight",
          "attn_k_norm.weight": "self_attn.k_norm.weight", "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
          "attn_gate.weight": "linear_attn.in_proj_z.weight", "ssm_beta.weight": "linear_attn.in_proj_b.weight",
          "ssm_alpha.weight": "linear_attn.in_proj_a.weight", "ssm_conv1d.weight": "linear_attn.conv1d.weight",
          "ssm_dt.bias": "linear_attn.dt_bias", "ssm_a": "linear_attn.A_log", "ssm_norm.weight": "linear_attn.norm.weight",
          "ssm_out.weight": "linear_attn.out_proj.weight",
          # qwen35moe's: the router, the experts stacked (read one per expert, weight_source.py), the shared expert
          # and its gate (stored [H], Hugging Face's [1, H])
          "ffn_gate_inp.weight": "mlp.gate.weight", "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
          "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
          "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
          "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
          "ffn_gate_exps.weight": "mlp.experts.{expert}.gate_proj.weight",
          "ffn_up_exps.weight": "mlp.experts.{expert}.up_proj.weight",
          "ffn_down_exps.weight": "mlp.experts.{expert}.down_proj.weight"}
_NEXTN = {"eh_proj.weight": "mtp.fc.weight", "enorm.weight": "mtp.pre_fc_norm_embedding.weight",
          "hnorm.weight": "mtp.pre_fc_norm_hidden.weight", "shared_head_norm.weight": "mtp.norm.weight"}
_PATTERN = re.compile(r"blk\.(\d+)\.(nextn\.)?(.+)")
_SHARED_GATE = "shared_expert_gate.weight"  # [1, H] in Hugging Face's checkpoints, [H] in the file


def qwen35_config(meta, tensors: dict, path: Path, companion: bool = False, architecture: str = ARCHITECTURE,
                  ) -> ModelConfig:
    """The config from the file's `qwen35.*` (or `qwen35moe.*`) metadata (`meta(key, default)`) and tensor names;
    `companion`: the file may hold the MTP layers alone (llama.cpp's --mtp companion, read by
    formats/mtp_companion.py). A qwen35moe file's experts are always renormalised (llama.cpp's graph: norm_w,
    softmax), with the gated shared expert beside them."""
    nextn = int(meta("nextn_predict_layers", 0))
    layers = int(meta("block_count")) - nextn
    heads, hidden = int(meta("attention.head_count")), int(meta("embedding_length"))
    head_dim = int(meta("attention.key_length", hidden // heads))
    value_heads = int(meta("ssm.time_step_rank"))
    recurrent = meta("attention.recurrent_layers")
    if isinstance(recurrent, list):
        kinds = ["linear_attention" if flag else "full_attention" for flag in recurrent[:layers]]
    else:
        interval = int(meta("full_attention_interval", 4))
        kinds = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    if "blk.0.attn_norm.weight" not in tensors and not companion:
        raise SpecDecodeError(f"{path} holds only MTP layers (llama.cpp's --mtp companion): load the model's own "
                              "file, and this one beside it (or with --draft-model) for --spec-type mtp")
    moe = None
    if architecture == MOE_ARCHITECTURE:
        if "blk.0.ffn_gate_up_exps.weight" in tensors:
            raise SpecDecodeError(f"{path} stores its experts' gate and up projections fused (the converter's "
                                  "--fuse-gate-up-exps), which is not read: convert it without that flag")
        moe = MoEConfig(num_experts=int(meta("expert_count")), experts_per_token=int(meta("expert_used_count")),
                        expert_size=int(meta("expert_feed_forward_length")), renormalize=True,
                        shared_size=int(meta("expert_shared_feed_forward_length")), shared_gate=True,
                        shared_name="shared_expert")
    return ModelConfig(
        architecture="qwen3_5_moe" if moe else "qwen3_5", vocab_size=int(tensors["token_embd.weight"].shape[1]),
        hidden_size=hidden,
        # a MoE model has no dense MLP: its width is unused, the shared expert's stands in (as config.py)
        intermediate_size=int(meta("feed_forward_length", moe.shared_size if moe else None)),
        num_layers=layers, num_heads=heads,
        num_kv_heads=int(meta("attention.head_count_kv", heads)), head_dim=head_dim,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta("rope.freq_base", 10000.0)), max_position_embeddings=int(meta("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors, qk_norm=True,
        mtp_layers=nextn if f"blk.{layers}.nextn.eh_proj.weight" in tensors else 0, mtp_declared=nextn,
        mtp_layout="top_level", layer_types=tuple(kinds), linear_num_key_heads=int(meta("ssm.group_count")),
        linear_num_value_heads=value_heads, linear_key_head_dim=int(meta("ssm.state_size")),
        linear_value_head_dim=int(meta("ssm.inner_size")) // value_heads,
        linear_conv_kernel=int(meta("ssm.conv_kernel", 4)), rotary_dim=int(meta("rope.dimension_count", head_dim)),
        attn_output_gate=True, zero_centred_norms=True, moe=moe)


def qwen35_hf_name(gguf_name: str, trunk_layers: int) -> str:
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    match = _PATTERN.fullmatch(gguf_name)
    if match is not None:
        block, nextn, part = int(match.group(1)), match.group(2), match.group(3)
        if nextn and part in _NEXTN:
            return _NEXTN[part]
        if not nextn and part in _BLOCK:
            return f"mtp.layers.{block - trunk_layers}.{_BLOCK[part]}" if block >= trunk_layers \
                else f"model.layers.{block}.{_BLOCK[part]}"
    raise SpecDecodeError(f"unsupported tensor {gguf_name!r} in a {ARCHITECTURE} or {MOE_ARCHITECTURE} GGUF file")


def _grouped_order(config: ModelConfig) -> torch.Tensor | None:
    """[Hv] the file's value head for each Hugging Face head (None when the file keeps HF's order)."""
    key_heads, value_heads = config.linear_num_key_heads, config.linear_num_value_heads
    if key_heads == value_heads:
        return None
    tiled = torch.arange(value_heads)  # the file's head j holds HF head (j % Hk) * r + j // Hk
    hf_of_file = (tiled % key_heads) * (value_heads // key_heads) + tiled // key_heads
    return torch.argsort(hf_of_file)


def value_rows(name: str, config: ModelConfig) -> torch.Tensor | None:
    """For a tensor whose rows the file reordered by value head: [rows] the file's row for each HF row."""
    order = _grouped_order(config)
    if order is None or not any(part in name for part in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b",
                                                          "conv1d", "dt_bias", "A_log")):
        return None
    per_head = 1 if any(part in name for part in ("in_proj_a", "in_proj_b", "dt_bias", "A_log")) \
        else config.linear_value_head_dim
    heads = (order.view(-1, 1) * per_head + torch.arange(per_head)).flatten()  # [Hv * per_head]
    if "in_proj_qkv" in name or "conv1d" in name:  # q and k rows first, in place
        keys = 2 * config.linear_num_key_heads * config.linear_key_head_dim
        return torch.cat([torch.arange(keys), heads + keys])
    return heads


def is_reordered_by_columns(name: str, config: ModelConfig) -> bool:
    return "out_proj" in name and _grouped_order(config) is not None


def to_hf_values(name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """A whole tensor as read from the file (float32, [out, in]) -> its Hugging Face values and order."""
    rows = value_rows(name, config)
    if rows is not None:
        tensor = tensor[rows]
    if is_reordered_by_columns(name, config):
        order = _grouped_order(config)
        columns = (order.view(-1, 1) * config.linear_value_head_dim
                   + torch.arange(config.linear_value_head_dim)).flatten()
        tensor = tensor[:, columns]
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return tensor - 1.0
    if name.endswith("A_log"):
        return torch.log(-tensor)
    if name.endswith("conv1d.weight"):
        return tensor.unsqueeze(1)  # [C, K] -> [C, 1, K]
    if name.endswith(_SHARED_GATE):
        return tensor.reshape(1, -1)  # [H] -> [1, H]
    return tensor


def transforms(name: str, config: ModelConfig) -> bool:
    """Whether the file's tensor differs from Hugging Face's in values or order (read whole, then converted)."""
    return (value_rows(name, config) is not None or is_reordered_by_columns(name, config)
            or name.endswith(("norm.weight", "A_log", "conv1d.weight", _SHARED_GATE)))


def hf_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A stored tensor's shape as Hugging Face's (the convolution's and the shared gate's squeezed dimension
    back)."""
    if name.endswith(_SHARED_GATE):
        return (1, *shape)
    return (shape[0], 1, shape[1]) if name.endswith("conv1d.weight") else shape


class Qwen35Layout(GGUFLayout):
    """A qwen35 file's names, value-head order and stored values, put back as Hugging Face's."""

    def __init__(self, config: ModelConfig):
        super().__init__(lambda name: qwen35_hf_name(name, config.num_layers))
        self.config = config

    def shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        return hf_shape(name, shape)

    def reorders(self, name: str) -> bool:
        return transforms(name, self.config)

    def rows(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        rows = value_rows(name, self.config)
        return tensor if rows is None else tensor[rows]

    def values(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return to_hf_values(name, tensor, self.config)

    def keeps_groups(self, name: str) -> bool:
        # Columns moved in blocks of value heads would split the file's groups: such a tensor is requantized.
        return not is_reordered_by_columns(name, self.config)

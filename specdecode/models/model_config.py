"""One config for every family we run: the sizes they share, and the parts only some have (a hybrid trunk's
recurrent layers, Gemma 4's). Each family reads and writes its own configs (models/families/); this module only
checks the values, whatever family filled them in."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from specdecode.errors import SpecDecodeError

# How MTP modules are named and ordered (decoder/mtp.py): after the trunk's layers (DeepSeek, GLM), under
# mtp_layers with the hidden state first (MiMo), or as a top-level mtp module (Qwen 3.5)
MTP_LAYOUTS = ("deepseek", "mimo", "top_level")
LAYER_TYPES = ("full_attention", "linear_attention", "sliding_attention")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2/2.5 carry a bias on q, k and v only
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3 normalises q and k per head before rope
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Multi-token-prediction modules (decoder/mtp.py): how many the weights hold and load, how many the config
    # declares (more when a conversion dropped them), and their naming.
    mtp_layers: int = 0
    mtp_declared: int = 0
    mtp_layout: str = "deepseek"
    # Hybrid trunks (Qwen 3.5): each layer's token mixer; () = every layer full attention. Gated DeltaNet layers
    # ("linear_attention", families/qwen3_5/gated_deltanet.py) have these sizes.
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 4
    rotary_dim: int | None = None  # rope on the first rotary_dim of each head's dims (None: all of them)
    attn_output_gate: bool = False  # Qwen 3.5's attention multiplies its output by sigmoid of a second query
    zero_centred_norms: bool = False  # RMSNorm weights w meaning x/rms(x) * (1 + w) (Qwen 3.5)
    # What only one family has, checked by its own `check(config)` (e.g. Gemma 4's GemmaParts,
    # families/gemma4/config.py); None for most.
    family_parts: Any = None
    # A mixture of experts' sizes and routing (decoder/moe.py's MoEConfig, checked by its `check(config)`); None
    # for a dense model.
    moe: Any = None
    # Multi-head latent attention's sizes (decoder/mla.py's MLAConfig, checked by its `check(config)`); None for
    # every other attention.
    mla: Any = None

    def __post_init__(self) -> None:
        for name, hf_name in _SIZES.items():
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise SpecDecodeError(f"config: {hf_name} must be a positive integer, got {value!r}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not _is_number(value) or not 0 < value < math.inf:
                raise SpecDecodeError(f"config: {name} must be a positive number, got {value!r}")
        if self.max_position_embeddings > MAX_POSITIONS:
            # The rope table covers every position at load: a typo here would ask for terabytes.
            raise SpecDecodeError(f"config: max_position_embeddings {self.max_position_embeddings} is above the "
                                  f"{MAX_POSITIONS} positions supported")
        if self.head_dim % 2:
            raise SpecDecodeError(f"config: head_dim must be even (rope rotates pairs), got {self.head_dim}")
        if self.sliding_window is not None and (type(self.sliding_window) is not int or self.sliding_window < 1):
            raise SpecDecodeError(f"config: sliding_window must be a positive integer, got {self.sliding_window!r}")
        if not all(type(t) is int for t in self.eos_token_ids) or not (
                self.bos_token_id is None or type(self.bos_token_id) is int):
            raise SpecDecodeError(f"config: bos_token_id and eos_token_id must be integers, got "
                                  f"{self.bos_token_id!r} and {list(self.eos_token_ids)!r}")
        _check_rope_scaling(self.rope_scaling)
        if type(self.mtp_declared) is not int or not 0 <= self.mtp_layers <= self.mtp_declared <= MAX_MTP_LAYERS:
            raise SpecDecodeError(f"config: num_nextn_predict_layers must be an integer from 0 to {MAX_MTP_LAYERS}, "
                                  f"got {self.mtp_declared!r}")
        if self.mtp_layout not in MTP_LAYOUTS:
            raise SpecDecodeError(f"config: unknown MTP layout {self.mtp_layout!r}")
        if self.num_heads % self.num_kv_heads:
            raise SpecDecodeError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads ({self.num_kv_heads})"
            )
        self._check_hybrid()
        if self.family_parts is not None:
            self.family_parts.check(self)
        if self.moe is not None:
            self.moe.check(self)
        if self.mla is not None:
            self.mla.check(self)

    def _check_hybrid(self) -> None:
        if self.layer_types and (len(self.layer_types) != self.num_layers
                                 or not set(self.layer_types) <= set(LAYER_TYPES)):
            raise SpecDecodeError(f"config: layer_types must name one of {', '.join(LAYER_TYPES)} for each of the "
                                  f"{self.num_layers} layers, got {list(self.layer_types)!r}")
        if self.rotary_dim is not None and (type(self.rotary_dim) is not int or self.rotary_dim % 2
                                            or not 0 < self.rotary_dim <= self.head_dim):
            raise SpecDecodeError(f"config: the rotary dimension must be even and at most head_dim "
                                  f"({self.head_dim}), got {self.rotary_dim!r}")
        if self.recurrent_layers:
            sizes = {"linear_num_key_heads": self.linear_num_key_heads,
                     "linear_num_value_heads": self.linear_num_value_heads,
                     "linear_key_head_dim": self.linear_key_head_dim,
                     "linear_value_head_dim": self.linear_value_head_dim,
                     "linear_conv_kernel_dim": self.linear_conv_kernel}
            for name, value in sizes.items():
                if type(value) is not int or value < 1:
                    raise SpecDecodeError(f"config: {name} must be a positive integer, got {value!r}")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise SpecDecodeError(f"config: linear_num_value_heads ({self.linear_num_value_heads}) must be a "
                                      f"multiple of linear_num_key_heads ({self.linear_num_key_heads})")

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        """The indices of the Gated DeltaNet layers (their recurrent states live in families/qwen3_5/cache.py)."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == "linear_attention")

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The indices of the layers with a KV cache, in cache order."""
        return tuple(i for i in range(self.num_layers) if i not in self.recurrent_layers)

    def common_hf(self) -> dict:
        """The config.json fields every family writes the same way (each family adds its own, families/)."""
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "mlp_bias": self.mlp_bias,
            "sliding_window": self.sliding_window,
            "use_sliding_window": self.sliding_window is not None,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) or None,
        }


# Our size fields and the names config.json gives them, for messages.
_SIZES = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
          "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
          "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
          "max_position_embeddings": "max_position_embeddings"}
MAX_POSITIONS = 1 << 20
MAX_MTP_LAYERS = 16


def _is_number(value) -> bool:
    return type(value) in (int, float)


def _check_rope_scaling(scaling: dict | None) -> None:
    """The fields rope.py reads, typed; an unknown rope_type is rejected there with the supported list."""
    if scaling is None:
        return
    if not isinstance(scaling, dict) or not isinstance(scaling.get("rope_type"), str):
        raise SpecDecodeError(f"config: rope_scaling must be an object with a rope_type, got {scaling!r}")
    if scaling["rope_type"] in ("linear", "llama3") and not (
            _is_number(scaling.get("factor")) and 0 < scaling["factor"] < math.inf):
        raise SpecDecodeError(f"config: rope_scaling.factor must be a positive number, got {scaling.get('factor')!r}")
    for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if key in scaling and not (_is_number(scaling[key]) and 0 < scaling[key] < math.inf):
            raise SpecDecodeError(f"config: rope_scaling.{key} must be a positive number, got {scaling[key]!r}")
    if scaling["rope_type"] == "yarn" and "original_max_position_embeddings" not in scaling:
        raise SpecDecodeError("config: yarn rope_scaling needs original_max_position_embeddings")
    if scaling["rope_type"] == "yarn" and scaling.get("factor") is not None and not (
            _is_number(scaling["factor"]) and 0 < scaling["factor"] < math.inf):
        raise SpecDecodeError(f"config: rope_scaling.factor must be a positive number, got {scaling['factor']!r}")
    if scaling["rope_type"] == "llama3" and scaling.get("low_freq_factor", 1.0) == scaling.get("high_freq_factor", 4.0):
        raise SpecDecodeError("config: rope_scaling.low_freq_factor and high_freq_factor must differ")


def eos_ids(hf: dict) -> tuple:
    """config.json's eos_token_id, one id or a list of them (checked to be integers in __post_init__)."""
    eos = hf.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())


def rope_theta(hf: dict) -> float:
    # transformers 5 moved rope_theta into rope_parameters; older configs keep it at the top level.
    params = hf.get("rope_parameters") or {}
    return float(hf.get("rope_theta") or params.get("rope_theta") or 10000.0)


def rope_scaling(hf: dict) -> dict | None:
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return None
    return {k: v for k, v in scaling.items() if k != "rope_theta"} | {"rope_type": kind}

"""One config for every supported Llama-family architecture: the differences between families are fields here."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specdecode.errors import SpecDecodeError
from specdecode.models.gemma_config import GemmaParts, check_text_only, gemma_parts, gemma_to_hf

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_5", "gemma4")
# Hugging Face model types that are one of ours plus multi-token-prediction layers (decoder/mtp.py), or one of ours
# under another name (Qwen 3.5's text-only and multimodal checkpoints; Qwen 3.6 dense ships as qwen3_5).
MTP_ARCHITECTURES = {"mimo": "qwen2", "qwen3_5_text": "qwen3_5", "gemma4_text": "gemma4"}
MTP_LAYOUTS = ("deepseek", "mimo", "qwen3_5")  # tensor naming and concat order, see decoder/mtp.py
# Known architectures we do not run, with why (inspect and load say it in one line).
NOT_SUPPORTED = {"qwen3_5_moe": "Qwen 3.5 MoE: the mixture-of-experts block is not implemented (the dense Qwen 3.5 "
                                "models are)",
                 "qwen3_5_moe_text": "Qwen 3.5 MoE: the mixture-of-experts block is not implemented",
                 "qwen35moe": "Qwen 3.5 MoE: the mixture-of-experts block is not implemented",
                 "qwen3_next": "Qwen3-Next: a mixture-of-experts hybrid; its experts are not implemented"}
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
    # ("linear_attention", decoder/gated_deltanet.py) have these sizes.
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 4
    rotary_dim: int | None = None  # rope on the first rotary_dim of each head's dims (None: all of them)
    attn_output_gate: bool = False  # Qwen 3.5's attention multiplies its output by sigmoid of a second query
    zero_centred_norms: bool = False  # RMSNorm weights w meaning x/rms(x) * (1 + w) (Qwen 3.5)
    gemma: GemmaParts | None = None  # a Gemma 4 trunk's own parts (gemma_config.py)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise SpecDecodeError(unsupported_message(self.architecture))
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
        if self.gemma is not None:
            self.gemma.check(self.num_layers, self.layer_types)

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
    def is_hybrid(self) -> bool:
        """Whether the trunk is built from decoder/hybrid.py's layers (Qwen 3.5) rather than the Llama family's."""
        return self.architecture == "qwen3_5"

    @property
    def is_gemma(self) -> bool:
        """Whether the trunk is Gemma 4's (decoder/gemma.py)."""
        return self.gemma is not None

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        """The indices of the Gated DeltaNet layers (their recurrent states live in recurrent_cache.py)."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == "linear_attention")

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The indices of the layers with a KV cache, in cache order."""
        return tuple(i for i in range(self.num_layers) if i not in self.recurrent_layers)

    @property
    def parameter_count(self) -> int:
        """Weights the architecture holds, from its sizes (a quantized model's buffers would miscount them)."""
        query_heads = self.num_heads * (2 if self.attn_output_gate else 1)
        attention = self.hidden_size * (query_heads + 2 * self.num_kv_heads) * self.head_dim \
            + self.num_heads * self.head_dim * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        key_dim = self.linear_num_key_heads * self.linear_key_head_dim
        value_dim = self.linear_num_value_heads * self.linear_value_head_dim
        recurrent = self.hidden_size * (2 * key_dim + 2 * value_dim + 2 * self.linear_num_value_heads) \
            + value_dim * self.hidden_size + (2 * key_dim + value_dim) * self.linear_conv_kernel
        mixers = len(self.attention_layers) * attention + len(self.recurrent_layers) * recurrent
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        mtp = 2 * self.hidden_size * self.hidden_size + attention + mlp  # eh_proj and the block (norms aside)
        if self.gemma is not None:  # PLE: a table and, per layer, a gate and a projection back
            ple = self.gemma.per_layer_size * (self.gemma.per_layer_vocab + 3 * self.hidden_size) * self.num_layers
            return embeddings + mixers + self.num_layers * mlp + ple
        return embeddings + mixers + self.num_layers * mlp + self.mtp_layers * mtp

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        """Build from a Hugging Face config.json dict; a missing or malformed field is one clear error."""
        try:
            return cls._from_hf(hf)
        except (KeyError, TypeError, ValueError, AttributeError, ArithmeticError) as error:
            raise SpecDecodeError(f"config.json is missing or has a malformed field ({error!r})") from None

    @classmethod
    def _from_hf(cls, hf: dict) -> ModelConfig:
        hf = _text_config(hf)
        model_type = hf.get("model_type")
        arch = MTP_ARCHITECTURES.get(model_type, model_type)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise SpecDecodeError(unsupported_message(arch or str(hf.get("architectures"))))
        if arch == "qwen3_5":
            return cls._qwen3_5(hf)
        if arch == "gemma4":
            return cls._gemma4(hf)
        num_heads = hf["num_attention_heads"]
        attention_bias = bool(hf.get("attention_bias", False))
        use_window = hf.get("use_sliding_window", arch == "mistral")
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(hf),
            rope_scaling=_rope_scaling(hf),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=True if arch == "qwen2" else attention_bias,
            o_bias=attention_bias and arch != "qwen2",
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=arch == "qwen3",
            sliding_window=hf.get("sliding_window") if use_window else None,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_eos_ids(hf),
            # Present until the loader finds otherwise (loader.read_config looks at the weights' names).
            mtp_layers=hf.get("num_nextn_predict_layers") or 0,
            mtp_declared=hf.get("num_nextn_predict_layers") or 0,
            mtp_layout="mimo" if model_type == "mimo" else "deepseek",
        )

    @classmethod
    def _qwen3_5(cls, hf: dict) -> ModelConfig:
        """Qwen 3.5 / 3.6 dense: Gated DeltaNet and gated full attention layers, zero-centred norms, partial
        rotary (its multimodal rope is plain rope for text: every section reads the same position)."""
        num_heads, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
        interval = hf.get("full_attention_interval", 4)
        layer_types = hf.get("layer_types") or [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
        mtp = hf.get("mtp_num_hidden_layers") or 0
        return cls(
            architecture="qwen3_5", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_layers=layers, num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads, head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=_rope_theta(hf),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=bool(hf.get("attention_bias", False)), o_bias=bool(hf.get("attention_bias", False)),
            qk_norm=True, bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_eos_ids(hf),
            mtp_layers=mtp, mtp_declared=mtp, mtp_layout="qwen3_5", layer_types=tuple(layer_types),
            linear_num_key_heads=hf["linear_num_key_heads"], linear_num_value_heads=hf["linear_num_value_heads"],
            linear_key_head_dim=hf["linear_key_head_dim"], linear_value_head_dim=hf["linear_value_head_dim"],
            linear_conv_kernel=hf.get("linear_conv_kernel_dim", 4), rotary_dim=int(head_dim * partial) // 2 * 2,
            attn_output_gate=True, zero_centred_norms=True)

    @classmethod
    def _gemma4(cls, hf: dict) -> ModelConfig:
        """Gemma 4's text trunk (gemma_config.py); its sizes of the sliding layers are the top-level ones."""
        check_text_only(hf)
        num_heads, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
        layer_types = list(hf.get("layer_types") or [
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)])
        layer_types[-1] = "full_attention"  # as transformers forces it
        if hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise SpecDecodeError(f"config: unsupported Gemma 4 activation {hf['hidden_activation']!r}")
        return cls(
            architecture="gemma4", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_layers=layers, num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads, head_dim=hf.get("head_dim", 256),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6), max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
            qkv_bias=bool(hf.get("attention_bias", False)), o_bias=bool(hf.get("attention_bias", False)),
            qk_norm=True, bos_token_id=hf.get("bos_token_id"), eos_token_ids=_eos_ids(hf),
            layer_types=tuple(layer_types), gemma=gemma_parts(hf, layer_types))

    def to_hf(self) -> dict:
        """The config.json we write next to converted weights, readable by transformers too."""
        hf = {
            "model_type": self.architecture,
            "architectures": [_HF_CLASS[self.architecture]],
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
        if self.architecture != "qwen2":
            hf["attention_bias"] = self.qkv_bias
        if self.gemma is not None:  # its ropes are per layer kind, in rope_parameters
            del hf["rope_theta"], hf["rope_scaling"]
            hf.update(gemma_to_hf(self.gemma, self.layer_types, self.head_dim, self.num_kv_heads))
            return hf
        if self.is_hybrid:
            hf.update(model_type="qwen3_5_text", layer_types=list(self.layer_types),
                      linear_num_key_heads=self.linear_num_key_heads,
                      linear_num_value_heads=self.linear_num_value_heads,
                      linear_key_head_dim=self.linear_key_head_dim, linear_value_head_dim=self.linear_value_head_dim,
                      linear_conv_kernel_dim=self.linear_conv_kernel, hidden_act="silu",
                      rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta,
                                       "partial_rotary_factor": self.rotary_dim / self.head_dim},
                      mtp_num_hidden_layers=self.mtp_layers)
            return hf
        if self.mtp_layers:
            hf["num_nextn_predict_layers"] = self.mtp_layers  # the layers written with it
            if self.mtp_layout == "mimo":  # MiMo is a Qwen2 trunk with MTP layers under its own names
                hf["model_type"], hf["architectures"] = "mimo", ["MiMoForCausalLM"]
        return hf


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
    if scaling["rope_type"] == "llama3" and scaling.get("low_freq_factor", 1.0) == scaling.get("high_freq_factor", 4.0):
        raise SpecDecodeError("config: rope_scaling.low_freq_factor and high_freq_factor must differ")


_HF_CLASS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "gemma4": "Gemma4ForCausalLM",
}


def unsupported_message(name: str | None) -> str:
    why = f" ({NOT_SUPPORTED[name]})" if name in NOT_SUPPORTED else ""
    return f"unsupported architecture {name!r}{why}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"


def _eos_ids(hf: dict) -> tuple:
    """config.json's eos_token_id, one id or a list of them (checked to be integers in __post_init__)."""
    eos = hf.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())


def _text_config(hf: dict) -> dict:
    """A multimodal checkpoint's language model config (Qwen 3.5's text_config), with the top level's token ids
    where the text part leaves them out; any other config as it is."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        return hf
    inherited = {key: hf[key] for key in ("bos_token_id", "eos_token_id", "tie_word_embeddings") if key in hf}
    return inherited | text


def _rope_theta(hf: dict) -> float:
    # transformers 5 moved rope_theta into rope_parameters; older configs keep it at the top level.
    params = hf.get("rope_parameters") or {}
    return float(hf.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(hf: dict) -> dict | None:
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return None
    return {k: v for k, v in scaling.items() if k != "rope_theta"} | {"rope_type": kind}

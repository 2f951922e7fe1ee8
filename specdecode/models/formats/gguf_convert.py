"""GGUF file -> Hugging Face-style folder (config.json, model.safetensors, tokenizer files), converted once.

The folder is what every later start loads (memory-mapped safetensors: seconds, not a minute), and transformers
can load it too, which keeps the reference tests and the benchmark peer on exactly the same weights.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from specdecode.errors import SpecDecodeError
from specdecode.models.formats import gguf_gemma4, gguf_qwen35
from specdecode.models.formats.atomic_folder import write_folder_atomically
from specdecode.models.formats.gguf_header import read_header
from specdecode.models.model_config import ModelConfig, unsupported_message
from specdecode.models.tokenizer import END_OF_TURN_TOKENS

# GGUF calls Mistral "llama"; both share one decoder here.
_GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",  # llama3 rope scaling factors; our loader reads them, transformers ignores them
}
_BLOCK_NAMES = {
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
_BLOCK_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# llama.cpp's multi-token-prediction ("nextn") tensors: gguf-py's names for DeepSeek's, in the last
# `{arch}.nextn_predict_layers` blocks, whose other tensors are an ordinary decoder layer (decoder/mtp.py).
_NEXTN_NAMES = {"eh_proj": "eh_proj", "enorm": "enorm", "hnorm": "hnorm", "shared_head_norm": "shared_head.norm",
                "shared_head_head": "shared_head.head", "embed_tokens": "embed_tokens"}
_NEXTN_PATTERN = re.compile(r"blk\.(\d+)\.nextn\.(\w+)\.weight")


def open_gguf(path: Path):
    """A GGUFReader over a checked file: a truncated, foreign or crafted file fails here with one clear message.

    gguf's reader believes every count and offset in the header (a crafted length is an OverflowError, a
    shape's element count wraps around in uint64): our own header parser checks them all against the file's
    size first (gguf_header.py)."""
    from gguf import GGUFReader

    read_header(path)
    try:
        return GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError, TypeError) as error:
        # Whatever the reader refuses beyond our checks: still one message, not its traceback.
        raise SpecDecodeError(f"{path} is truncated or corrupt: not a readable GGUF file ({error})") from None


def field_value(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None or not field.data:
        return default
    if field.types and field.types[0].name == "STRING" and len(field.data) == 1:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    values = [field.parts[i].tolist() for i in field.data]
    values = [v[0] if isinstance(v, list) and len(v) == 1 else v for v in values]
    return values[0] if len(values) == 1 else values


def config_from_gguf(reader, path: Path, companion: bool = False) -> ModelConfig:
    """`companion`: the file may hold MTP layers alone (llama.cpp's --mtp companion)."""
    try:
        return _config_from_gguf(reader, path, companion)
    except (KeyError, TypeError, ValueError, ArithmeticError) as error:  # a zero head count divides by zero
        raise SpecDecodeError(f"{path}: GGUF metadata is missing or malformed ({error!r})") from None


def _config_from_gguf(reader, path: Path, companion: bool) -> ModelConfig:
    gguf_arch = field_value(reader, "general.architecture")
    gguf_gemma4.check_not_assistant(gguf_arch, path)
    if gguf_arch not in _GGUF_ARCHITECTURES and gguf_arch not in (gguf_qwen35.ARCHITECTURE, gguf_gemma4.ARCHITECTURE):
        raise SpecDecodeError(f"{path}: {unsupported_message(gguf_arch)}")

    def meta(key, default=None):
        return field_value(reader, f"{gguf_arch}.{key}", default)

    tensors = {t.name: t for t in reader.tensors}
    if gguf_arch == gguf_qwen35.ARCHITECTURE:
        return gguf_qwen35.qwen35_config(meta, tensors, path, companion)
    if gguf_arch == gguf_gemma4.ARCHITECTURE:
        return gguf_gemma4.gemma4_config(meta, tensors, field_value(reader, "tokenizer.ggml.eos_token_id"),
                                         field_value(reader, "tokenizer.ggml.bos_token_id"))
    hidden = int(meta("embedding_length"))
    # llama.cpp counts the MTP blocks in block_count; the trunk is the blocks before them.
    nextn = int(meta("nextn_predict_layers", 0))
    trunk_layers = int(meta("block_count")) - nextn
    mtp_present = nextn if f"blk.{trunk_layers}.nextn.eh_proj.weight" in tensors else 0
    heads = int(meta("attention.head_count"))
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    rope_scaling = None
    if meta("rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
    return ModelConfig(
        architecture=_GGUF_ARCHITECTURES[gguf_arch],
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=trunk_layers,
        num_heads=heads,
        num_kv_heads=int(meta("attention.head_count_kv", heads)),
        head_dim=int(meta("attention.key_length", hidden // heads)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(meta("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        o_bias="blk.0.attn_output.bias" in tensors,
        mlp_bias="blk.0.ffn_down.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
        mtp_layers=mtp_present,
        mtp_declared=nextn,
    )


def hf_namer(reader, config: ModelConfig):
    """The file's tensor name -> its Hugging Face name, for this file's layout."""
    if field_value(reader, "general.architecture") == gguf_qwen35.ARCHITECTURE:
        return lambda name: gguf_qwen35.qwen35_hf_name(name, config.num_layers)
    if config.is_gemma:
        return gguf_gemma4.gemma4_hf_name
    return hf_name


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    nextn = _NEXTN_PATTERN.fullmatch(gguf_name)
    if nextn is not None and nextn.group(2) in _NEXTN_NAMES:
        return f"model.layers.{nextn.group(1)}.{_NEXTN_NAMES[nextn.group(2)]}.weight"
    match = _BLOCK_PATTERN.fullmatch(gguf_name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        raise SpecDecodeError(f"unsupported tensor {gguf_name!r} in GGUF file")
    block, part, kind = match.groups()
    return f"model.layers.{block}.{_BLOCK_NAMES[part]}.{kind}"


_DEQUANTIZE_ROWS = 4096  # gguf-py's dequantizers make several full-size temporaries: bound them by chunks


def dequantize_tensor(tensor, rows: slice = slice(None)) -> np.ndarray:
    """One GGUF tensor (or the rows `rows` of a 2-D one) -> float32 array in PyTorch's [out, in] layout,
    dequantized a chunk of rows at a time."""
    from gguf import dequantize

    data = tensor.data[rows]  # [rows, bytes per row] for quantized types, [rows, columns] otherwise
    if data.ndim < 2 or len(data) <= _DEQUANTIZE_ROWS:
        array = np.asarray(dequantize(data, tensor.tensor_type), dtype=np.float32)
        # Unquantized tensors come back as read-only views of the memory-mapped file; torch wants its own copy.
        return array if array.flags.writeable else array.copy()
    first = dequantize(data[:1], tensor.tensor_type)  # [1, columns]
    out = np.empty((len(data), first.shape[-1]), dtype=np.float32)  # [rows, columns]
    for start in range(0, len(data), _DEQUANTIZE_ROWS):
        out[start : start + _DEQUANTIZE_ROWS] = dequantize(data[start : start + _DEQUANTIZE_ROWS], tensor.tensor_type)
    return out


def unpermute_llama_qk(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter interleaves rotary halves of q/k rows for the llama architecture; undo that.

    Its permute views each head's rows as [2, D/2] and swaps to [D/2, 2]; the inverse views them as [D/2, 2].
    """
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def permuted_heads(name: str, config: ModelConfig, permute: bool) -> int | None:
    """How many heads a llama-architecture file (`permute`) interleaved the rows of tensor `name` over, or None
    when its rows are stored in Hugging Face order."""
    if permute and ".q_proj." in name:
        return config.num_heads
    if permute and ".k_proj." in name:
        return config.num_kv_heads
    return None


def to_hf_rows(name: str, tensor: torch.Tensor, config: ModelConfig, permute: bool) -> torch.Tensor:
    """A tensor (weight, bias, or per-row int4 codes/scales) under Hugging Face `name`, with q/k rows back in
    Hugging Face order when the file is a llama-architecture one (`permute`), or a qwen35 file's value heads
    (gguf_qwen35.py)."""
    if config.is_hybrid:
        rows = gguf_qwen35.value_rows(name, config)
        return tensor if rows is None else tensor[rows]
    heads = permuted_heads(name, config, permute)
    return tensor if heads is None else unpermute_llama_qk(tensor, heads)


def to_hf_tensor(name: str, tensor: torch.Tensor, config: ModelConfig, permute: bool) -> torch.Tensor:
    """A whole tensor as the file stores it -> Hugging Face's values (a qwen35 file's norms, A_log, convolution
    and value-head order; a llama file's q/k rows)."""
    if config.is_hybrid:
        return gguf_qwen35.to_hf_values(name, tensor, config)
    return to_hf_rows(name, tensor, config, permute)


def convert_gguf(path: Path, out_dir: Path, dtype: torch.dtype, quiet: bool = False) -> Path:
    """Write `out_dir` whole or not at all, so an interrupted conversion is never mistaken for done."""
    reader = open_gguf(path)
    config = config_from_gguf(reader, path)
    state: dict[str, torch.Tensor] = {}
    permute = field_value(reader, "general.architecture") == "llama"
    names = hf_namer(reader, config)
    for tensor in tqdm(reader.tensors, desc=f"converting {path.name}", unit="tensor", disable=quiet):
        name = names(tensor.name)
        weight = to_hf_tensor(name, torch.from_numpy(dequantize_tensor(tensor)), config, permute)
        state[name] = weight if name == "rope_freqs" else weight.to(dtype)

    def write(staging: Path) -> None:
        save_file(state, staging / "model.safetensors", metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(config.to_hf() | {"torch_dtype": str(dtype)[6:]}, indent=1))
        write_tokenizer(path, staging, config)

    return write_folder_atomically(out_dir, write)


def write_tokenizer(path: Path, out_dir: Path, config: ModelConfig) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    # AutoTokenizer reads the file's model config as well, which transformers cannot for a gemma4 file with the
    # double-wide MLP (one feed-forward size per layer); the tokenizer class itself reads the vocabulary alone.
    tokenizer_class = PreTrainedTokenizerFast if config.is_gemma else AutoTokenizer

    # transformers prefers tokenizer files beside the GGUF file to its metadata (a model folder holding both
    # loses the file's chat template), so it reads the file from a folder of its own, through a link.
    with tempfile.TemporaryDirectory() as alone:
        link = Path(alone) / path.name
        try:
            link.symlink_to(path.resolve())
        except OSError:  # no symbolic links here: read it where it is
            link = path
        try:
            tokenizer = tokenizer_class.from_pretrained(str(link.parent), gguf_file=link.name)
        except (ValueError, KeyError, OSError, TypeError) as error:
            raise SpecDecodeError(f"{path}: could not build a tokenizer from the GGUF metadata ({error})") from None
    tokenizer.save_pretrained(str(out_dir))
    vocab = tokenizer.get_vocab()
    eos = sorted({*config.eos_token_ids, *(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)})
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": eos}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=1))

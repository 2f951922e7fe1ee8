"""GGUF file -> Hugging Face-style folder (config.json, model.safetensors, tokenizer files), converted once.

The folder is what every later start loads (memory-mapped safetensors: seconds, not a minute), and transformers
can load it too, which keeps the reference tests and the benchmark peer on exactly the same weights. The file's
tensors are read through its family's layout (model_files.open_gguf_weights), so the folder holds Hugging Face's
names and values.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from specdecode.errors import SpecDecodeError
from specdecode.models.families.registry import config_to_hf, family_of
from specdecode.models.formats.atomic_folder import write_folder_atomically
from specdecode.models.model_config import ModelConfig
from specdecode.models.model_files import open_gguf_weights
from specdecode.models.tokenizer import END_OF_TURN_TOKENS


def convert_gguf(path: Path, out_dir: Path, dtype: torch.dtype, quiet: bool = False) -> Path:
    """Write `out_dir` whole or not at all, so an interrupted conversion is never mistaken for done."""
    weights = open_gguf_weights(path)
    config = weights.config
    state: dict[str, torch.Tensor] = {}
    for name in tqdm(sorted(weights.names()), desc=f"converting {path.name}", unit="tensor", disable=quiet):
        weight = weights.get(name)  # float32, Hugging Face's values and row order
        # Saved under the names transformers reads: "model." before the trunk's (not the head's, nor rope factors)
        key = name if name in ("lm_head.weight", "rope_freqs") or name.startswith("mtp.") else f"model.{name}"
        state[key] = weight if name == "rope_freqs" else weight.to(dtype)

    def write(staging: Path) -> None:
        save_file(state, staging / "model.safetensors", metadata={"format": "pt"})
        hf = config_to_hf(config) | {"torch_dtype": str(dtype)[6:]}
        (staging / "config.json").write_text(json.dumps(hf, indent=1))
        write_tokenizer(path, staging, config)

    return write_folder_atomically(out_dir, write)


def write_tokenizer(path: Path, out_dir: Path, config: ModelConfig) -> None:
    """The GGUF file's own vocabulary, merges and chat template as Hugging Face tokenizer files in `out_dir`."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    # AutoTokenizer reads the file's model config as well, which transformers cannot for some families' files;
    # the tokenizer class itself reads the vocabulary alone.
    alone = family_of(config).tokenizer_from_gguf_alone()
    tokenizer_class = PreTrainedTokenizerFast if alone else AutoTokenizer

    # transformers prefers tokenizer files beside the GGUF file to its metadata (a model folder holding both
    # loses the file's chat template), so it reads the file from a folder of its own, through a link.
    with tempfile.TemporaryDirectory() as folder:
        link = Path(folder) / path.name
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

"""MTP layers in a GGUF file of their own, beside a main file that has none: llama.cpp's companion layout.

llama.cpp's converter can publish a model as two files (`convert_hf_to_gguf.py --no-mtp`, then `--mtp`): the
trunk alone (block_count L, no `{arch}.nextn_predict_layers`), and `mtp-NAME.gguf`, which holds only the MTP
layers and what they need. That companion has the trunk's `general.architecture`, block_count L+n and
`{arch}.nextn_predict_layers` n, the layers at `blk.{L+j}.*` (nextn.* plus an ordinary block), its own copies of
`token_embd`, `output_norm` and `output`, and the tokenizer; nothing marks it but its name and the missing
`blk.0.*` (llama.cpp's loaders tell it by that; its download code pairs files whose names hold "mtp-").
drafter-formats.md and the #14 notes give the sources.

Here the companion's MTP layers join the target's as the `mtp` drafter's own modules (model_files.load_companion
reads them). Its copies of the embedding and head are not read: as with DeepSeek's shared copies, the target's
are used.
"""

from __future__ import annotations

from pathlib import Path

from specdecode.errors import SpecDecodeError
from specdecode.models.formats.gguf_header import read_header

COMPANION_MARK = "mtp-"  # what llama.cpp's download code looks for in a companion's file name
# The sizes a companion's metadata states, which must be the target's (num_layers: the trunk before the MTP layers).
MATCHING_FIELDS = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                    "num_kv_heads", "head_dim")


def companion_beside(gguf_file: Path) -> Path | None:
    """The MTP companion of `gguf_file` in its folder, from headers alone: a file whose name holds "mtp-", with
    the same architecture and trunk depth, holding MTP layers and no trunk; None when there is none."""
    try:
        main = read_header(gguf_file).metadata
    except SpecDecodeError:
        return None
    arch = main.get("general.architecture")
    trunk = int(main.get(f"{arch}.block_count", 0)) - int(main.get(f"{arch}.nextn_predict_layers", 0))
    for candidate in sorted(gguf_file.parent.glob("*.gguf")):
        if candidate == gguf_file or COMPANION_MARK not in candidate.name.lower():
            continue
        try:
            header = read_header(candidate)
        except SpecDecodeError:
            continue  # an unreadable neighbour is not ours to judge; loading it by name says what is wrong
        layers = _companion_layers(header.metadata, header.types)
        if header.metadata.get("general.architecture") == arch and layers and \
                int(header.metadata[f"{arch}.block_count"]) - layers == trunk:
            return candidate
    return None


def companion_layers(path: Path) -> int:
    """How many MTP layers the GGUF file `path` holds as a companion, from its header (0: not a companion)."""
    header = read_header(path)
    return _companion_layers(header.metadata, header.types)


def _companion_layers(metadata: dict, types: dict) -> int:
    """How many MTP layers a file holds as a companion (its nextn blocks present, no trunk block 0), else 0."""
    arch = metadata.get("general.architecture")
    count = int(metadata.get(f"{arch}.nextn_predict_layers", 0))
    trunk = int(metadata.get(f"{arch}.block_count", 0)) - count
    present = all(f"blk.{trunk + j}.nextn.eh_proj.weight" in types for j in range(count))
    return count if count and present and "blk.0.attn_norm.weight" not in types else 0

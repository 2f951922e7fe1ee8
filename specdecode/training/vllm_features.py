"""Training features from hidden states vLLM wrote, in the offline layout of vllm-project/speculators (its
`launch_vllm.py` serves the target with vLLM's `extract_hidden_states` method and `ExampleHiddenStatesConnector`;
`data_generation_offline.py` sends every prepared conversation through it): the target's forwards run in vLLM,
across the user's GPUs, and are converted here into our features (features.py), which every drafter kind then
trains on. The target is still loaded here, whole, for its final norm and output head (the soft labels) and
what a drafter starts from. The facts, with their sources: docs/training.md.

    DIR/hs_{i}.safetensors   row i of the prepared dataset (no manifest: the listing is the index)
        hidden_states  [T, n, H]  the target's residual stream at the captured layer ids, ascending (vLLM's
                                  boundary ids, ours too), the last slot the last layer before the final norm;
                                  the model's dtype, or float8_e4m3fn with
        hidden_states_scales [T, 1, 1] float32 (hs-connectors' fp8 connector: state = fp8 * scale, in bf16)
        token_ids      [T] int64  the prompt's tokens
    DATASET/  a Hugging Face `datasets` folder (save_to_disk: state.json, data-*.arrow in Arrow's stream
              format), rows with input_ids and loss_mask (1 where the token is the assistant's)

The loss mask comes only from the dataset, read with pyarrow (the `vllm` extra); nothing is unpickled. A row
whose token_ids differ from its dataset row is skipped, as speculators' own reader does. Soft labels are the
target's top-K law at each position, recomputed from the last slot through the target's final norm and output
head (what speculators trains against). Loss-mask meaning: ours at t is "token t+1 is learned", speculators' at t
"token t is the assistant's", so ours[t] = theirs[t+1] (and the last position counts with the last token, as our
own features count it). Each row is held out (for acceptance measured while training) by a hash of its name.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specdecode.errors import SpecDecodeError
from specdecode.models.loader import LoadedModel
from specdecode.training.data import is_held_out
from specdecode.training.features import TOP_K
from specdecode.training.ranks import Ranks

KIND = "vllm"  # the shards' kind (ORDINAL-KIND): held-out acceptance is reported under it
SAMPLE = re.compile(r"hs_(\d+)\.safetensors")


@dataclass
class Sample:
    tokens: torch.Tensor  # [T] long
    hidden: torch.Tensor  # [T, n, H] float32: the captured layers, ascending, the last layer last


def sample_files(folder: Path) -> dict[int, Path]:
    """Row index -> its hs_{i}.safetensors in `folder` (files still being written, *.lock beside them, left out)."""
    if not folder.is_dir():
        raise SpecDecodeError(f"{folder} is not a folder of vLLM hidden states (hs_*.safetensors)")
    found = {}
    for path in folder.iterdir():
        match = SAMPLE.fullmatch(path.name)
        if match and not path.with_name(path.name + ".lock").exists():
            found[int(match.group(1))] = path
    if not found:
        raise SpecDecodeError(f"{folder} holds no hs_*.safetensors files (speculators' offline layout)")
    return dict(sorted(found.items()))


def sample_length(path: Path) -> int:
    """A sample's token count, from its header alone."""
    with safe_open(str(path), "pt") as file:
        return file.get_slice("token_ids").get_shape()[0]


def read_sample(path: Path, captured: int) -> Sample:
    """One sample, checked to hold `captured` layers, an fp8 one dequantized as hs-connectors does."""
    try:
        tensors = load_file(str(path))
    except (OSError, ValueError) as error:  # truncated, or not safetensors: safetensors says which
        raise SpecDecodeError(f"cannot read {path} ({error})") from None
    if "hidden_states" not in tensors or "token_ids" not in tensors:
        raise SpecDecodeError(f"{path} lacks hidden_states or token_ids: not a vLLM hidden-states file")
    hidden, tokens = tensors["hidden_states"], tensors["token_ids"].long()  # [T, n, H], [T]
    if hidden.dim() != 3 or hidden.shape[0] != tokens.numel():
        raise SpecDecodeError(f"{path}: hidden_states {tuple(hidden.shape)} do not match {tokens.numel()} tokens")
    if hidden.shape[1] != captured:
        raise SpecDecodeError(f"{path} holds {hidden.shape[1]} layers, --vllm-layer-ids names {captured}: give the "
                              "ids vLLM was served with (launch_vllm.py --target-layer-ids, the last layer included)")
    if "hidden_states_scales" in tensors:  # [T, 1, 1]: the fp8 connector's per-token scales
        hidden = hidden.to(torch.bfloat16) * tensors["hidden_states_scales"].to(torch.bfloat16)
    return Sample(tokens, hidden.float())


def read_dataset_rows(folder: Path) -> list[tuple[list[int], list[int]]]:
    """The prepared dataset's rows in order -> (input_ids, loss_mask) each, from its Arrow files."""
    try:
        import pyarrow as pa
    except ImportError:
        raise SpecDecodeError("reading speculators' loss masks needs pyarrow: pip install 'specdecode[vllm]'"
                              ) from None
    try:
        state = json.loads((folder / "state.json").read_text())
        files = [folder / entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SpecDecodeError(f"{folder} is not a saved Hugging Face dataset (state.json: {error})") from None
    rows: list[tuple[list[int], list[int]]] = []
    for path in files:
        try:
            with pa.memory_map(str(path)) as source:
                table = pa.ipc.open_stream(source).read_all()
        except (OSError, pa.ArrowException) as error:
            raise SpecDecodeError(f"cannot read {path} ({error})") from None
        if not {"input_ids", "loss_mask"} <= set(table.column_names):
            raise SpecDecodeError(f"{path} has no input_ids and loss_mask columns: not speculators' prepared data")
        rows += zip(table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist())
    return rows


def our_loss_mask(theirs: list[int]) -> torch.Tensor:
    """speculators' mask (token t is the assistant's) -> ours [T] bool (position t's next token is learned)."""
    mask = torch.tensor(theirs, dtype=torch.bool)  # [T]
    return torch.cat([mask[1:], mask[-1:]])


@torch.inference_mode()
def soft_labels(target: LoadedModel, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The last layer's states [T, H] (before the final norm) -> the target's top-K next tokens [T, K] and their
    log-probabilities [T, K], as our own features compute them (the final norm, then the output head)."""
    model = target.model
    logits = model.lm_head(model.norm(last.to(device=model.device, dtype=model.dtype))).float()  # [T, V]
    top_logprobs, top_ids = torch.log_softmax(logits, dim=-1).topk(TOP_K, dim=-1)
    return top_ids.int().cpu(), top_logprobs.cpu()


def convert(target: LoadedModel, hidden_states: Path, dataset: Path, captured: int, folder: Path,
            ranks: Ranks = Ranks()) -> tuple[int, int]:
    """Write a shard (features.py's layout) for every sample this rank owns (row index modulo the world size),
    skipping those written before -> (training tokens this rank wrote or found, samples skipped for tokens that
    differ from their dataset row)."""
    rows = read_dataset_rows(dataset)
    tokens_done, skipped = 0, 0
    for index, path in sample_files(hidden_states).items():
        if index % ranks.world != ranks.rank:
            continue
        split = "held_out" if is_held_out(path.stem) else "train"
        shard = folder / split / f"{index:06d}-{KIND}.safetensors"
        if shard.exists():
            tokens_done += sample_length(path) if split == "train" else 0
            continue
        if index >= len(rows):
            raise SpecDecodeError(f"{path.name} has no row in {dataset} ({len(rows)} rows): another dataset?")
        sample = read_sample(path, captured)
        input_ids, loss_mask = rows[index]
        if sample.tokens.tolist() != input_ids:  # vLLM tokenized it otherwise: speculators skips it too
            skipped += 1
            continue
        write_converted(target, sample, our_loss_mask(loss_mask), shard)
        tokens_done += sample.tokens.numel() if split == "train" else 0
    return tokens_done, skipped


def write_converted(target: LoadedModel, sample: Sample, loss_mask: torch.Tensor, path: Path) -> None:
    """One sample as our shard, written whole: its layers side by side (bf16, as our own features), the soft
    labels from its last layer."""
    top_ids, top_logprobs = soft_labels(target, sample.hidden[:, -1])
    shard = {"tokens": sample.tokens.int(), "hidden": sample.hidden.flatten(1).bfloat16(), "top_ids": top_ids,
             "top_logprobs": top_logprobs, "loss_mask": loss_mask}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(shard, str(path.with_suffix(".partial")))
    path.with_suffix(".partial").replace(path)

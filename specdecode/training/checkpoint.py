"""A training run's checkpoint: the drafter's and the optimizer's full state dicts, the learning-rate schedule,
the global step, the draft vocabulary and what the run was made with. Nothing in it depends on how many ranks
wrote it or whether they sharded the drafter, and the data order is a function of the step and the seed
(loop.py), so a run resumes on any number of ranks. Rank 0 writes it whole (a temporary name, then a rename)."""

from __future__ import annotations

from pathlib import Path

import torch

from specdecode.errors import SpecDecodeError

CHECKPOINT = "checkpoint.pt"
FORMAT = 2  # 2: full state dicts keyed by parameter name (1, unmarked: the optimizer's keyed by position)


def read_checkpoint(path: Path, device: str) -> dict | None:
    """The checkpoint at `path`, or None when there is none yet."""
    if not path.exists():
        return None
    # Our own file, written below; weights_only refuses anything but tensors and plain data.
    state = torch.load(path, map_location=device, weights_only=True)
    if state.get("format") != FORMAT:
        raise SpecDecodeError(f"{path} was written by an earlier version of the trainer and cannot be resumed; "
                              "delete it (the features are kept) or use another --out")
    return state


def write_checkpoint(path: Path, head: dict, optimizer: dict, schedule: dict, step: int, draft_ids: torch.Tensor,
                     made_with: dict, measured: dict[str, list[float]]) -> None:
    """head, optimizer: full state dicts (parallel.full_state); schedule: the LR scheduler's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"format": FORMAT, "head": head, "optimizer": optimizer, "schedule": schedule, "step": step,
             "draft_ids": draft_ids, "made_with": made_with, "measured": measured}
    partial = path.with_suffix(".partial")
    torch.save(state, partial)
    partial.replace(path)

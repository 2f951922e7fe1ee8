"""Real multi-process training runs for the tests: torch.multiprocessing starts each rank as its own process,
which joins a gloo process group through torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), as `torchrun` would start it. Nothing of torch.distributed is mocked."""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.multiprocessing as mp

from specdecode.models.loader import load_model
from specdecode.training import ranks
from specdecode.training.dflash import train_dflash
from specdecode.training.eagle3 import train_eagle3
from specdecode.training.loop import TrainSettings

TRAINERS = {"eagle3": train_eagle3, "dflash": train_dflash}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def one_thread() -> Iterator[None]:
    """One torch thread, as each spawned rank runs: a matmul's sums then do not depend on how many threads
    split it, so a one-process run and a two-process run differ only where the ranks' work is joined."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def train(kind: str, target_folder: Path, features: Path, out: Path, settings: TrainSettings,
          snapshot_at: int | None = None, snapshot: Path | None = None) -> dict:
    """One process's run (rank 0 of 1 without a process group; one of several inside one); with `snapshot_at`,
    rank 0 copies the checkpoint written at that step to `snapshot` (the run goes on)."""
    target = load_model(target_folder, dtype="float32")

    def keep(step: int, tokens: int, measured: dict) -> None:
        if step == snapshot_at:
            snapshot.mkdir(parents=True, exist_ok=True)
            shutil.copy(out / "checkpoint.pt", snapshot / "checkpoint.pt")

    return TRAINERS[kind](target, features, out, settings, quiet=True, on_eval=keep)


def _rank(rank: int, world: int, port: int, kind: str, target_folder: Path, features: Path, out: Path,
          settings: TrainSettings, snapshot_at: int | None, snapshot: Path | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    ranks.start(ranks.from_environment(), settings.device)
    try:
        train(kind, target_folder, features, out, settings, snapshot_at, snapshot)
    finally:
        ranks.stop()


def train_on_ranks(world: int, kind: str, target_folder: Path, features: Path, out: Path, settings: TrainSettings,
                   snapshot_at: int | None = None, snapshot: Path | None = None) -> None:
    """`world` processes training together over gloo, as torchrun would start them; returns when all are done
    (an error in any rank is raised here)."""
    mp.spawn(_rank, args=(world, free_port(), kind, target_folder, features, out, settings, snapshot_at, snapshot),
             nprocs=world, join=True)

"""Where this process stands among training ranks, as torchrun tells it (RANK, WORLD_SIZE, LOCAL_RANK in the
environment), the process group, and the few collectives training needs. One process alone is rank 0 of 1, and
every collective below is then the identity, so the same code trains on one process or many.

The backend follows the device: NCCL for CUDA ranks (one GPU per rank, cuda:LOCAL_RANK), gloo on the CPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from specdecode.errors import SpecDecodeError

T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    rank: int = 0  # this process's place among all ranks, on every host
    world: int = 1  # ranks in all
    local_rank: int = 0  # its place on its own host (which GPU it drives)

    @property
    def main(self) -> bool:
        """Rank 0, which alone writes checkpoints, logs, the result and the progress bar."""
        return self.rank == 0

    def share(self, items: list) -> list:
        """This rank's items of a list every rank holds whole: every world-th from its own place, so the ranks
        together take each item once (at most one item more on the first ranks)."""
        return items[self.rank :: self.world]


def from_environment() -> Ranks:
    """The ranks torchrun (or any launcher following its variables) started; rank 0 of 1 without them."""
    try:
        ranks = Ranks(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                      int(os.environ.get("LOCAL_RANK", 0)))
    except ValueError as error:
        raise SpecDecodeError(f"torchrun's RANK, WORLD_SIZE or LOCAL_RANK is not a number ({error})") from None
    if not 0 <= ranks.rank < ranks.world:
        raise SpecDecodeError(f"RANK {ranks.rank} is outside WORLD_SIZE {ranks.world}")
    return ranks


def start(ranks: Ranks, device: str) -> str:
    """Join the process group (when there is more than one rank) -> this rank's device: a CUDA rank drives
    cuda:LOCAL_RANK, as torchrun's one process per GPU expects."""
    if device.startswith("cuda") and ranks.world > 1:
        if ":" in device:
            raise SpecDecodeError(f"--device {device} names one GPU, but each of the {ranks.world} ranks drives its "
                                  "own (cuda:LOCAL_RANK): use --device cuda")
        if ranks.local_rank >= torch.cuda.device_count():
            raise SpecDecodeError(f"this host has {torch.cuda.device_count()} GPUs and torchrun started more ranks on "
                                  "it: one rank per GPU (--nproc-per-node, --nproc)")
        device = f"cuda:{ranks.local_rank}"
        torch.cuda.set_device(device)
    if ranks.world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", rank=ranks.rank,
                                world_size=ranks.world)
    return device


def stop() -> None:
    """Leave the process group, if this process joined one."""
    if dist.is_initialized():
        dist.destroy_process_group()


def current() -> Ranks:
    """This process's ranks as its process group says (the device aside: start() chose it); rank 0 of 1 alone."""
    if not joined():
        return Ranks()
    return Ranks(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))


def joined() -> bool:
    """Whether this process trains beside others (a process group of more than one rank)."""
    return dist.is_initialized() and dist.get_world_size() > 1


def sum_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """The elementwise sum of every rank's `tensor` (a new tensor, no gradient)."""
    total = tensor.detach().clone()
    if joined():
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total


def gathered(value) -> list:
    """Every rank's `value` (small plain data), in rank order."""
    if not joined():
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def wait_for_all() -> None:
    """Every rank reaches this point before any goes on (rank 0 wrote what the others read next)."""
    if joined():
        dist.barrier()


def main_first(action: Callable[[], T]) -> T:
    """`action` on rank 0, then on the others once it is done: what rank 0 writes (a manifest, the target's topic
    lists), the others read. A user's error on rank 0 is raised on every rank, so none waits for it forever."""
    if not joined():
        return action()
    failure, result = None, None
    if current().main:
        try:
            result = action()
        except SpecDecodeError as error:
            failure = str(error)
    failure = gathered(failure)[0]  # rank 0's outcome, on every rank (and a barrier)
    if failure is not None:
        raise SpecDecodeError(failure)
    return result if current().main else action()

"""The drafter's trained weights under torch's data parallelism: DistributedDataParallel by default (each rank
holds the whole drafter and its optimizer state; gradients are averaged over ranks after each backward), or FSDP
(torch.distributed.fsdp.fully_shard) where the drafter is large: parameters, gradients and AdamW's moments
are sharded over the ranks and gathered whole only for each step's forward and backward.

Both hook a module's `forward`, so the objective runs inside one (`Objective`). Checkpoints hold full state
dicts, whatever the sharding, through torch.distributed.checkpoint's state-dict functions: the same file resumes
on any number of ranks, sharded or not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

from specdecode.training.features import Shard
from specdecode.training.ranks import Ranks
from specdecode.training.ttt import UnrollResult

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on rank 0's CPU


class Objective(nn.Module):
    """The trained module and its objective as one forward, the call DDP and FSDP wrap: DDP readies its gradient
    averaging and FSDP gathers the sharded parameters around it."""

    def __init__(self, module: nn.Module, objective: Callable[[Shard, torch.Tensor], UnrollResult],
                 autocast: torch.autocast):
        super().__init__()
        self.module = module  # the weights trained; the objective reaches them through the drafter's own objects
        self.objective = objective
        self.autocast = autocast

    def forward(self, shards: list[Shard], target_to_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's sequences of a step -> (loss sums [n_terms] summed over them, their weights [n_terms])."""
        results = []
        for shard in shards:
            # An autocast region per sequence: each casts the weights to bf16 anew, so the sequences' gradients
            # meet in float32 at the parameters (one region would add them in bf16 at its cached cast, and the
            # sum would then depend on how the batch is split over ranks).
            with self.autocast:
                results.append(self.objective(shard, target_to_draft))
        return (torch.stack([r.loss_sums for r in results]).sum(0),
                torch.stack([r.loss_weights for r in results]).sum(0))


def distribute(objective: Objective, ranks: Ranks, device: str, fsdp: bool) -> nn.Module:
    """What a training step calls: the objective itself on one rank, else under DDP or, with `fsdp`, sharded in
    place (the returned module is then `objective`, now an FSDP module)."""
    if ranks.world == 1:
        return objective
    if fsdp:
        fully_shard(objective)
        return objective
    # A static graph: every step uses the same parameters, which DDP then learns once, those that get no
    # gradient included (MTP modules beyond --unroll's steps, untrained as on one process).
    return DistributedDataParallel(objective, device_ids=[torch.device(device).index] if device.startswith("cuda")
                                   else None, static_graph=True)


def sharded(objective: Objective) -> bool:
    return isinstance(objective, FSDPModule)


@contextmanager
def whole_parameters(objective: Objective) -> Iterator[None]:
    """The drafter's parameters whole on every rank for the duration (held-out measurement calls the objective
    outside a training forward): FSDP gathers them and shards them again after; otherwise nothing to do."""
    if not sharded(objective):
        yield
        return
    objective.unshard()
    try:
        yield
    finally:
        objective.reshard()


def full_state(objective: Objective, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(the trained module's state dict, the optimizer's, keyed by parameter name), whole on rank 0 (others may
    get empty dicts); every rank must call it (FSDP gathers the shards)."""
    model = get_model_state_dict(objective, options=FULL)
    prefix = "module."
    return ({name.removeprefix(prefix): tensor for name, tensor in model.items()},
            get_optimizer_state_dict(objective, optimizer, options=FULL))


def load_full_state(objective: Objective, optimizer: torch.optim.Optimizer, model: dict, optimizer_state: dict
                    ) -> None:
    """Put a full state (full_state's, read from a checkpoint by every rank) into a module sharded or not."""
    whole = StateDictOptions(full_state_dict=True)
    set_model_state_dict(objective, {"module." + name: tensor for name, tensor in model.items()}, options=whole)
    set_optimizer_state_dict(objective, optimizer, optimizer_state, options=whole)

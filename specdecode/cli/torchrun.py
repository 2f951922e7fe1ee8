"""`specdecode train ... --nproc N`: the same command under torchrun on this host, N processes, through
torchrun's own entry (torch.distributed.run, as `torchrun --standalone --nproc-per-node N -m specdecode ...`
runs it). Each process is a rank of the command (training/ranks.py); a rank's error is printed by rank 0 as
one line, and this process exits with the failed rank's code, without torchrun's report of the failure."""

from __future__ import annotations

import logging
import os

from specdecode.errors import SpecDecodeError

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def without_nproc(argv: list[str]) -> list[str]:
    """The command's arguments less `--nproc N` (or `--nproc=N`): what each rank runs."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            kept.append(arg)
    return kept


def launch(nproc: int, argv: list[str]) -> int:
    """Run `python -m specdecode ARGV` as `nproc` ranks on this host -> the exit code (the first failed rank's)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if any(name in os.environ for name in TORCHRUN_VARIABLES):
        raise SpecDecodeError("--nproc launches torchrun, and this process already is a torchrun rank: leave "
                              "--nproc out under torchrun")
    # torchrun's agent logs each step of a launch and a failed rank's whole report, and torchrun a banner that it
    # runs each rank on one thread (docs/training.md says so); the ranks say what matters.
    for name in ("torch.distributed.elastic", "torch.distributed.run"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(parse_args(["--standalone", f"--nproc-per-node={nproc}", "-m", "specdecode", *argv]))
    except ChildFailedError as failure:
        codes = [error.exitcode for error in failure.failures.values()]
        return next((code for code in codes if code > 0), 1)  # a rank killed by a signal has a negative code
    return 0

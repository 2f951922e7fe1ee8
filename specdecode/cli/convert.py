"""`specdecode convert FOLDER`: a checkpoint that ships only pickled weights (pytorch_model*.bin, as the EAGLE
reference's heads do) gets a model.safetensors beside them. The only place we unpickle, on the user's explicit
request, and then with torch.load(weights_only=True), which refuses anything but tensors and plain containers."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specdecode.errors import SpecDecodeError


def add_parser(commands) -> None:
    convert = commands.add_parser("convert", help="write model.safetensors for a folder that ships only "
                                  "pytorch_model*.bin (read with torch.load(weights_only=True))")
    convert.add_argument("folder", help="the checkpoint folder")
    convert.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch
    from safetensors.torch import save_file

    folder = Path(args.folder)
    out = folder / "model.safetensors"
    if not folder.is_dir():
        raise SpecDecodeError(f"{folder} is not a folder")
    if out.exists():
        raise SpecDecodeError(f"{out} already exists; nothing to convert")
    pickled = sorted(folder.glob("pytorch_model*.bin"))
    if not pickled:
        raise SpecDecodeError(f"{folder} holds no pytorch_model*.bin to convert")
    tensors: dict[str, torch.Tensor] = {}
    for file in pickled:
        try:
            loaded = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 - unpickling raises anything; each is the file's fault
            raise SpecDecodeError(f"{file} is not a weights-only PyTorch checkpoint ({type(error).__name__}: "
                                  f"{error})") from None
        if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
            raise SpecDecodeError(f"{file} does not hold a flat name -> tensor dictionary")
        tensors.update(loaded)
    # safetensors refuses tensors that share memory: each gets its own contiguous copy.
    staging = out.with_suffix(".partial")
    try:
        save_file({name: t.detach().clone().contiguous() for name, t in tensors.items()}, str(staging))
        staging.replace(out)  # all or nothing: an interrupted run leaves no half-written model.safetensors
    except OSError as error:
        staging.unlink(missing_ok=True)
        raise SpecDecodeError(f"cannot write {out} ({error})") from None
    print(f"wrote {out} ({len(tensors)} tensors from {', '.join(p.name for p in pickled)})", file=sys.stderr)
    return 0

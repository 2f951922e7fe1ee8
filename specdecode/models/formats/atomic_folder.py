"""Cache folders written whole or not at all."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_folder_atomically(folder: Path, write: Callable[[Path], None]) -> Path:
    """Run write(staging) in a sibling temp folder, then rename it to `folder` (replacing an old one), so an
    interrupted write is never mistaken for a finished one and never leaves a half-written folder behind."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        write(staging)
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(staging, folder)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return folder

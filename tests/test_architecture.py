"""The layers hold: import-linter's contracts (pyproject.toml, docs/architecture.md) over the whole package."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_every_import_follows_the_layer_rules():
    # Beside this interpreter first: a virtual environment's tools need not be on PATH.
    beside = Path(sys.executable).parent / "lint-imports"
    linter = str(beside) if beside.is_file() else shutil.which("lint-imports")
    if linter is None:
        pytest.fail("lint-imports is missing: install the test extra (pip install -e '.[test]' -c constraints.txt)")
    run = subprocess.run([linter, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    broken = run.stdout[run.stdout.find("Broken contracts"):] if "Broken contracts" in run.stdout else run.stdout
    assert run.returncode == 0, f"an import breaks a layer rule (docs/architecture.md):\n{broken}{run.stderr}"
    assert "0 broken" in run.stdout

"""Training text that can be had offline, built from this Python's own standard library: never a public
benchmark (HumanEval, MBPP, MT-bench, GSM8K, Spec-Bench and the like are what we measure on).

Two kinds, as EAGLE-style self-distillation wants: prompts made from the standard library's documented
functions (the target answers them itself, so the drafter learns the target's own style), and the library's
source as teacher-forced code text. A module is held out (for acceptance measured while training) by a hash of
its name, so the split never changes between runs or machines.
"""

from __future__ import annotations

import ast
import hashlib
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HELD_OUT_PERCENT = 5
TASKS = (
    "Write a Python function `{name}{signature}` that does the following.\n\n{doc}",
    "Implement `{name}{signature}` in Python. Its documentation says:\n\n{doc}\n\nExplain the code briefly.",
    "What does `{module}.{name}` do? Show a short example of using it.",
)


@dataclass(frozen=True)
class TrainingText:
    module: str
    text: str  # a prompt (the target answers it) or code (teacher-forced)
    kind: str  # "answer" (a standard-library task), "chat" (training/chat_tasks.py) or "code"

    @property
    def is_prompt(self) -> bool:
        return self.kind != "code"

    @property
    def held_out(self) -> bool:
        return is_held_out(self.module)


def is_held_out(module: str) -> bool:
    return int(hashlib.sha256(module.encode()).hexdigest(), 16) % 100 < HELD_OUT_PERCENT


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's Python sources in a fixed order (tests, idlelib and site-packages left out)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "turtledemo"}
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))


def _module_name(path: Path, root: Path) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts)


def prompts(root: Path | None = None) -> Iterator[TrainingText]:
    """A task per documented public function, cycling through TASKS."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    count = 0
    for path in stdlib_files(root):
        module = _module_name(path, root)
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):  # a few files are templates or in other encodings
            continue
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 40:
                continue
            signature = f"({ast.unparse(node.args)})"
            first_paragraph = doc.strip().split("\n\n")[0]
            task = TASKS[count % len(TASKS)]
            count += 1
            yield TrainingText(module, task.format(name=node.name, signature=signature, doc=first_paragraph,
                                                   module=module), "answer")


def code_texts(root: Path | None = None, chars: int = 2400) -> Iterator[TrainingText]:
    """The library's source in pieces of about `chars` characters, cut at line ends."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    for path in stdlib_files(root):
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        module = _module_name(path, root)
        piece: list[str] = []
        size = 0
        for line in source.splitlines(keepends=True):
            piece.append(line)
            size += len(line)
            if size >= chars:
                yield TrainingText(module, "".join(piece), "code")
                piece, size = [], 0
        if size > chars // 4:
            yield TrainingText(module, "".join(piece), "code")

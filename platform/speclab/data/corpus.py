"""The default text corpus every machine has: the Python standard library's own source.

Files are found through ``sysconfig`` and split deterministically BY FILE (a hash of
the path relative to the stdlib root) into train / validation / test, so the same
machine-independent split comes out everywhere. Prompt sets are cut from the test
split: the text before a ``def`` header plus the header itself, to be completed.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

SPLITS = ("train", "validation", "test")


def stdlib_root() -> Path:
    """The folder of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """All ``.py`` files of the standard library (no site-packages), sorted by path."""
    root = stdlib_root()
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = [p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def split_of(rel_path: str, fractions: tuple[float, float] = (0.9, 0.05)) -> str:
    """Deterministic split of one file: train 90%, validation 5%, test 5%."""
    h = int(hashlib.sha1(rel_path.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    if h < fractions[0]:
        return "train"
    return "validation" if h < fractions[0] + fractions[1] else "test"


def split_files(split: str) -> list[Path]:
    """The stdlib files of one split."""
    if split not in SPLITS:
        raise ValueError(f"split: must be one of {SPLITS}, got {split!r}")
    root = stdlib_root()
    return [p for p in stdlib_files() if split_of(p.relative_to(root).as_posix()) == split]


def read_text(files: list[Path], max_chars: int | None = None) -> str:
    """Concatenate files (separated by a blank line) up to ``max_chars`` characters."""
    parts, total = [], 0
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        parts.append(text)
        total += len(text)
        if max_chars is not None and total >= max_chars:
            break
    out = "\n\n".join(parts)
    return out[:max_chars] if max_chars is not None else out


@dataclass(frozen=True)
class Prompt:
    """A prompt to complete and where it came from."""

    text: str
    source: str


def function_header_prompts(
    split: str = "test", n: int = 32, context_chars: int = 300, seed: int = 0
) -> list[Prompt]:
    """Up to ``n`` prompts: ``context_chars`` of text before a ``def`` line, plus the line.

    Deterministic for a given ``seed``: files are visited in a seeded order and at most
    two prompts are taken per file.
    """
    import random

    root = stdlib_root()
    files = split_files(split)
    random.Random(seed).shuffle(files)
    prompts: list[Prompt] = []
    for f in files:
        try:
            lines = f.read_text(encoding="utf-8").splitlines(keepends=True)
        except (UnicodeDecodeError, OSError):
            continue
        taken = 0
        offset = 0
        for i, line in enumerate(lines):
            offset += len(line)
            if line.lstrip().startswith("def ") and line.rstrip().endswith(":") and i > 5:
                text = "".join(lines[: i + 1])[-context_chars - len(line):]
                prompts.append(Prompt(text, f"{f.relative_to(root).as_posix()}:{i + 1}"))
                taken += 1
                if taken == 2 or len(prompts) == n:
                    break
        if len(prompts) == n:
            break
    return prompts

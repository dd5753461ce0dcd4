"""JSON Lines files read line by line, every error naming the config field and line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


def json_lines(path: str | Path, field: str = "data.path") -> Iterator[tuple[int, object]]:
    """``(line number, object)`` of each non-blank line of a JSONL file; ValueError
    naming ``field`` and the line when the file is missing or a line is not JSON."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"{field}: {str(path)!r} does not exist")
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield i, json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{field}: {path}:{i} is not JSON ({exc.msg})") from None

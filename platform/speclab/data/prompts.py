"""Prompt sets for evaluation: stdlib function headers or a user JSONL file.

JSONL: one object per line with a ``prompt`` field (``response`` is optional and ignored
here). Bad lines are reported with their line number.
"""

from __future__ import annotations

import json
from pathlib import Path

from speclab.data.corpus import function_header_prompts


def load_jsonl_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    """Prompts from a JSONL file (field ``prompt``)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"data.path: {str(path)!r} does not exist")
    out = []
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"data.path: {path}:{i} is not JSON ({exc.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
            raise ValueError(f"data.path: {path}:{i} needs a non-empty string field 'prompt'")
        out.append(obj["prompt"])
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise ValueError(f"data.path: {path} holds no prompts")
    return out


def load_prompts(kind: str, num_prompts: int, context_chars: int = 300, path: str | None = None,
                 seed: int = 0) -> list[str]:
    """Prompt texts for a ``data`` config group."""
    if kind == "jsonl":
        return load_jsonl_prompts(path, num_prompts)
    return [p.text for p in function_header_prompts("test", num_prompts, context_chars, seed)]


def held_out_prompts(kind: str, num_prompts: int, skip: int, context_chars: int = 300,
                     path: str | None = None, seed: int = 0) -> list[str]:
    """Prompts of ``kind`` that an evaluation of the first ``skip`` prompts of the same
    ``data`` group never sees: stdlib function headers from the validation split (the
    evaluation reads the test split), or the JSONL file's prompts after its first
    ``skip``. Up to ``num_prompts``; may be empty for a short JSONL file."""
    if kind == "jsonl":
        return load_jsonl_prompts(path)[skip: skip + num_prompts]
    return [p.text for p in
            function_header_prompts("validation", num_prompts, context_chars, seed)]

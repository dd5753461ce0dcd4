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
    """Up to ``num_prompts`` prompts of ``kind`` from the evaluation's own prompt sequence
    that an evaluation of its first ``skip`` prompts never sees: the JSONL file's prompts
    after its first ``skip``; for stdlib function headers the LAST ``num_prompts`` of the
    test split's sequence (the one :func:`load_prompts` reads from its start; at most two
    prompts per file, so other files than the evaluation's), never before index ``skip``.
    The tail, so that an evaluation of more prompts (the bench's 16) does not meet them
    either. The evaluation's split, not the validation split it once was: one set of
    prompts predicts another only up to their sampling spread, and the validation
    split's first 64 headers happened to be easy ones (Medusa heads: chain tau 2.41 on
    them, 2.22 on the next 64, 2.20 on 83 test prompts; closing note of stop 50). May be
    empty."""
    if kind == "jsonl":
        return load_jsonl_prompts(path)[skip: skip + num_prompts]
    every = function_header_prompts("test", 10**9, context_chars, seed)
    return [p.text for p in every[max(skip, len(every) - num_prompts):]]

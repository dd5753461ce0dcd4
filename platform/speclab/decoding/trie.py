"""Prefix trie of valid item identifiers (AtSpeed: semantic ids of L tokens each).

Constrained decoding may only emit a token that keeps the prefix inside the trie.
"""

from __future__ import annotations

from collections.abc import Sequence


class ItemTrie:
    """Valid token sequences (all of length ``L``) and the items they name."""

    def __init__(self, sequences: Sequence[Sequence[int]], items: Sequence[int] | None = None):
        if not sequences:
            raise ValueError("trie: needs at least one item sequence")
        lengths = {len(s) for s in sequences}
        if len(lengths) != 1:
            raise ValueError(f"trie: all item ids must have the same length, got {sorted(lengths)}")
        self.length = lengths.pop()
        items = list(items) if items is not None else list(range(len(sequences)))
        self._item: dict[tuple[int, ...], int] = {}
        self._next: dict[tuple[int, ...], list[int]] = {}
        for seq, item in zip(sequences, items):
            key = tuple(int(t) for t in seq)
            if key in self._item:
                raise ValueError(f"trie: token sequence {key} is used by two items")
            self._item[key] = int(item)
            for i in range(self.length):
                nxt = self._next.setdefault(key[:i], [])
                if key[i] not in nxt:
                    nxt.append(key[i])
        for v in self._next.values():
            v.sort()

    def allowed(self, prefix: Sequence[int]) -> list[int]:
        """Tokens that may follow ``prefix`` (empty at full length or off the trie)."""
        return self._next.get(tuple(prefix), [])

    def item_of(self, seq: Sequence[int]) -> int:
        """The item a full token sequence names (KeyError if it is not an item)."""
        return self._item[tuple(seq)]

    def __contains__(self, seq: Sequence[int]) -> bool:
        return tuple(seq) in self._item

    def __len__(self) -> int:
        return len(self._item)

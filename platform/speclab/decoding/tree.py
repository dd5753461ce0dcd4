"""TokenTree: the one draft structure for chains, trees, beams and retrieved n-grams.

Node 0 is the root: the last committed token, not yet processed by the target.
Every other node has a parent with a smaller index (nodes are appended in
topological order), so ``depth[i] = depth[parent[i]] + 1``.

What verification needs is stored per node:

* ``q_prob[i]``: the draft's probability of ``tokens[i]`` given its parent (the scoring
  distribution; used for path probabilities and stats);
* ``child_kind[j]``: how the children of node ``j`` were produced: ``"sampled"`` (drawn
  i.i.d. from ``q_dist[j]``, verified by rejection with residual ``max(p - q, 0)``) or
  ``"deterministic"`` (chosen, e.g. top-k; verified as point-mass proposals);
* ``q_dist[j]``: ``[V]`` the exact proposal distribution at an expanded node ``j`` whose
  children were sampled.

Tree attention: a node sees the committed prefix, its ancestors and itself; its
position id is ``prefix_len + depth``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from speclab.decoding.host import longs
from speclab.decoding.wire import pack_tensor, unpack_tensor

SAMPLED = "sampled"
DETERMINISTIC = "deterministic"


class TokenTree:
    """A rooted token tree built by appending nodes parent-first."""

    def __init__(self, root_token: int) -> None:
        self.tokens: list[int] = [int(root_token)]
        self.parents: list[int] = [-1]
        self.depths: list[int] = [0]
        self.q_prob: list[float] = [1.0]
        self.path_prob: list[float] = [1.0]
        self.children: list[list[int]] = [[]]
        self.child_kind: dict[int, str] = {}
        self.q_dist: dict[int, torch.Tensor] = {}
        # nodes a relaxed rule may accept by threshold (AASD: retrieved from the prompt
        # or alignment-sampled); the rule and its parameters are the request's, not the tree's
        self.relaxed: list[bool] = [False]

    # ------------------------------------------------------------------ building
    def add(self, token: int, parent: int, q_prob: float = 1.0, relaxed: bool = False) -> int:
        """Append a child of ``parent``; returns the new node's index. ``relaxed`` marks
        a node AASD's conditional verification may accept by threshold."""
        if not 0 <= parent < len(self.tokens):
            raise IndexError(f"parent {parent} not in tree of {len(self.tokens)} nodes")
        idx = len(self.tokens)
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.q_prob.append(float(q_prob))
        self.path_prob.append(self.path_prob[parent] * float(q_prob))
        self.children.append([])
        self.children[parent].append(idx)
        self.relaxed.append(bool(relaxed))
        return idx

    def set_children_kind(self, node: int, kind: str, q_dist: torch.Tensor | None = None) -> None:
        """Record how ``node``'s children were drafted (and, if sampled, from what ``q``)."""
        if kind not in (SAMPLED, DETERMINISTIC):
            raise ValueError(f"child kind must be {SAMPLED!r} or {DETERMINISTIC!r}, got {kind!r}")
        if kind == SAMPLED and q_dist is None:
            raise ValueError("sampled children need the proposal distribution q_dist")
        self.child_kind[node] = kind
        if q_dist is not None:
            self.q_dist[node] = q_dist

    def find_child(self, node: int, token: int) -> int:
        """Index of ``node``'s child carrying ``token``, or -1."""
        for c in self.children[node]:
            if self.tokens[c] == token:
                return c
        return -1

    @classmethod
    def chain(cls, root_token: int, tokens: Sequence[int]) -> TokenTree:
        """A chain root -> tokens[0] -> tokens[1] -> ... (deterministic children)."""
        tree = cls(root_token)
        node = 0
        for t in tokens:
            tree.set_children_kind(node, DETERMINISTIC)
            node = tree.add(t, node)
        return tree

    @classmethod
    def from_sequences(cls, root_token: int, sequences: Sequence[Sequence[int]]) -> TokenTree:
        """Merge token sequences (beams, retrieved n-grams) into a prefix trie.

        Nodes are added level by level (all first tokens, then all second tokens, ...),
        which reproduces AtSpeed's flattened beam order (Table 3: "a1 a2 b1 b2 c1 c2").
        """
        tree = cls(root_token)
        at = [0] * len(sequences)
        for level in range(max((len(s) for s in sequences), default=0)):
            for i, seq in enumerate(sequences):
                if level >= len(seq):
                    continue
                parent = at[i]
                child = tree.find_child(parent, seq[level])
                if child < 0:
                    tree.set_children_kind(parent, DETERMINISTIC)
                    child = tree.add(seq[level], parent)
                at[i] = child
        return tree

    # ------------------------------------------------------------------ queries
    # ------------------------------------------------------------------ transport
    def to_wire(self) -> dict:
        """The tree in plain form (what a draft deployment sends a target deployment):
        ``tokens``/``parents``/``q_prob``/``relaxed`` per node, ``child_kind``, and the
        ``[V]`` proposal distributions of the expanded nodes whose children were sampled
        as ONE packed ``[n, V]`` tensor (``q_dist``, :func:`~speclab.decoding.wire.
        pack_tensor`) with their node ids (``q_nodes``). :meth:`from_wire` rebuilds an
        equal tree."""
        nodes = sorted(self.q_dist)
        q = torch.stack([self.q_dist[k].float().cpu() for k in nodes]) if nodes else None
        return {"tokens": list(self.tokens), "parents": list(self.parents),
                "q_prob": list(self.q_prob), "relaxed": list(self.relaxed),
                "child_kind": {str(k): v for k, v in self.child_kind.items()},
                "q_nodes": nodes, "q_dist": pack_tensor(q)}

    @classmethod
    def from_wire(cls, data: dict) -> TokenTree:
        """Inverse of :meth:`to_wire`; raises ValueError on a malformed tree."""
        tokens, parents = data["tokens"], data["parents"]
        if not tokens or len(parents) != len(tokens) or parents[0] != -1:
            raise ValueError("tree: tokens/parents must be equal-length lists rooted at -1")
        tree = cls(tokens[0])
        for i in range(1, len(tokens)):
            tree.add(tokens[i], parents[i], data["q_prob"][i], data["relaxed"][i])
        q = unpack_tensor(data["q_dist"])
        nodes = [int(k) for k in data["q_nodes"]]
        if (q is None) != (not nodes) or (q is not None and q.shape[0] != len(nodes)):
            raise ValueError(f"tree: {len(nodes)} q_nodes for a q_dist of shape "
                             f"{None if q is None else tuple(q.shape)}")
        dists = dict(zip(nodes, q if q is not None else [], strict=True))
        for k, kind in data["child_kind"].items():
            tree.set_children_kind(int(k), kind, dists.get(int(k)))
        return tree

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_drafted(self) -> int:
        """Number of draft tokens (all nodes but the root)."""
        return len(self.tokens) - 1

    def is_chain(self) -> bool:
        """True when every node's parent is the node before it."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to ``node`` inclusive."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def ancestor_matrix(self) -> torch.Tensor:
        """``[T, T]`` bool, ``[i, j]`` True iff ``j`` is ``i`` or an ancestor of ``i``."""
        return visibility_mask(len(self.tokens), 0, self.ancestor_lists())

    def ancestor_lists(self, offset: int = 0) -> list[list[int]]:
        """Per node, ``offset`` + the indices of its ancestors and itself (root first)."""
        out: list[list[int]] = []
        for i, p in enumerate(self.parents):
            out.append([*out[p], offset + i] if p >= 0 else [offset + i])
        return out

    def token_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[T]`` token ids."""
        return longs(self.tokens).to(device)

    def position_ids(self, prefix_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[T]`` positions ``prefix_len + depth``."""
        return longs([prefix_len + d for d in self.depths]).to(device)

    def attention_mask(self, prefix_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[T, prefix_len + T]`` bool: each node sees the prefix, its ancestors, itself."""
        n = len(self.tokens)
        mask = visibility_mask(prefix_len + n, prefix_len, self.ancestor_lists(prefix_len))
        return mask.to(device)


def visibility_mask(width: int, prefix: int, seen: Sequence[Sequence[int]]) -> torch.Tensor:
    """``[len(seen), width]`` bool: row ``r`` sees columns ``[0, prefix)`` and ``seen[r]``.

    Written into a byte buffer and wrapped as ONE tensor: a tree's mask is built every
    draft and verify forward, and one tensor write per entry cost 2-3% of a tree
    method's decoding time on the reference pair (profiled)."""
    row = b"\x01" * prefix + b"\x00" * (width - prefix)
    buf = bytearray(row * len(seen))
    for r, cols in enumerate(seen):
        at = r * width
        for c in cols:
            buf[at + c] = 1
    if not buf:
        return torch.zeros(len(seen), width, dtype=torch.bool)
    return torch.frombuffer(buf, dtype=torch.bool).view(len(seen), width)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool ``[T, S]`` -> additive float mask ``[1, 1, T, S]`` (0 where allowed, min elsewhere).

    A float mask is right for both sdpa and eager attention in transformers 5 (a bool
    mask silently gives wrong results with eager).
    """
    out = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    out.masked_fill_(~allowed, torch.finfo(dtype).min)
    return out[None, None]


def select_subtree(tree: TokenTree, keep: Sequence[int]) -> tuple[TokenTree, dict[int, int]]:
    """A new tree with the nodes ``keep`` (must contain 0 and be closed under parents).

    Returns the new tree and the map old index -> new index. Children kinds and
    proposal distributions are carried over.
    """
    keep_sorted = sorted(set(keep))
    if not keep_sorted or keep_sorted[0] != 0:
        raise ValueError("select_subtree: the root (node 0) must be kept")
    new = TokenTree(tree.tokens[0])
    old_to_new = {0: 0}
    for old in keep_sorted[1:]:
        parent = tree.parents[old]
        if parent not in old_to_new:
            raise ValueError(f"select_subtree: node {old} kept without its parent {parent}")
        old_to_new[old] = new.add(tree.tokens[old], old_to_new[parent], tree.q_prob[old])
    for old, kind in tree.child_kind.items():
        if old in old_to_new:
            new.child_kind[old_to_new[old]] = kind
            if old in tree.q_dist:
                new.q_dist[old_to_new[old]] = tree.q_dist[old]
    return new, old_to_new

"""Greedy verification: follow the target's argmax through the tree (lossless at T = 0)."""

from __future__ import annotations

import torch

from speclab.decoding.host import fetch_lists
from speclab.decoding.rules.verdict import Verdict
from speclab.decoding.tree import TokenTree


def verify_greedy(tree: TokenTree, target_logits: torch.Tensor) -> Verdict:
    """Follow the target's argmax through the tree.

    Args:
        tree: draft tree with ``T`` nodes.
        target_logits: ``[T, V]`` target logits at every node.
    """
    return follow_argmax(tree, fetch_lists(target_logits.argmax(-1))[0])


def follow_argmax(tree: TokenTree, best: list[int]) -> Verdict:
    """:func:`verify_greedy` on the host: ``best[i]`` is the target's argmax at node ``i``."""
    node, path, evaluated = 0, [0], 0
    while True:
        if tree.children[node]:
            evaluated += 1
        child = tree.find_child(node, best[node])
        if child < 0:
            return Verdict(path, best[node], evaluated)
        node = child
        path.append(node)

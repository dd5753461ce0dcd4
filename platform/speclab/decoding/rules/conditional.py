"""AASD conditional verification (eq. 4-6). RELAXED: it changes outputs.

A node marked ``relaxed`` (retrieved from the prompt or alignment-sampled) passes if
``p(x) >= min(alpha * H(p) + beta, max p)``; other nodes only if they are the argmax;
the longest passing path wins. Defined over greedy decoding: it is refused at T > 0.
"""

from __future__ import annotations

import torch

from speclab.decoding.host import fetch_lists, to_device
from speclab.decoding.rules.verdict import Verdict
from speclab.decoding.tree import TokenTree


def conditional_threshold(p: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    """AASD eq. 5-6: ``min(-alpha * sum p log p + beta, max p)`` for ``p`` ``[..., V]``.

    Capped by ``max p``, so the most likely token always passes.
    """
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)
    return torch.minimum(alpha * entropy + beta, p.max(-1).values)


def verify_conditional(tree: TokenTree, target_logits: torch.Tensor, alpha: float,
                       beta: float) -> Verdict:
    """AASD conditional verification over a tree (greedy base).

    Args:
        tree: ``T`` nodes; ``tree.relaxed[i]`` marks context-retrieved / alignment-sampled
            nodes that may pass by threshold; others must equal the target's argmax.
        target_logits: ``[T, V]`` target logits at every node.
    Returns the longest path whose every node passes; the bonus is the argmax after it.
    """
    if alpha < 0:
        raise ValueError(f"aasd_alpha: must be >= 0, got {alpha}")
    best, limit, p_at = fetch_lists(*conditional_inputs(tree, target_logits, alpha, beta))
    return conditional_on_host(tree, best, limit, p_at)


def conditional_inputs(tree: TokenTree, target_logits: torch.Tensor, alpha: float,
                       beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What :func:`conditional_on_host` reads, on the logits' device, each ``[T]``: the
    target's argmax at every node, the eq. 5 threshold at every node, and every node's
    token's probability under its parent (0 at the root)."""
    p = target_logits.float().softmax(-1)
    parents = to_device(torch.tensor([max(i, 0) for i in tree.parents]), p.device)
    tokens = to_device(torch.tensor(tree.tokens), p.device)
    p_at = p[parents, tokens]
    p_at[0] = 0.0
    return p.argmax(-1), conditional_threshold(p, alpha, beta), p_at


def conditional_on_host(tree: TokenTree, best: list[int], limit: list[float],
                        p_at: list[float]) -> Verdict:
    """:func:`verify_conditional` over host lists (see :func:`conditional_inputs`)."""

    def passes(child: int) -> bool:
        if tree.tokens[child] == best[tree.parents[child]]:
            return True
        return tree.relaxed[child] and p_at[child] >= limit[tree.parents[child]]

    longest: list[int] = [0]
    stack = [[0]]
    while stack:  # depth-first over passing nodes; keep the longest path
        path = stack.pop()
        if len(path) > len(longest):
            longest = path
        stack.extend(path + [c] for c in tree.children[path[-1]] if passes(c))
    evaluated = sum(1 for n in longest if tree.children[n])
    return Verdict(longest, best[longest[-1]], evaluated)

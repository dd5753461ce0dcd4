"""Speculative sampling over a chain or a tree (Leviathan et al. Algorithm 1; recursive
rejection over siblings, SpecInfer-style). Lossless at any temperature when ``p`` and
``q`` were warped identically.

Siblings drafted i.i.d. from ``q`` are accepted with ``min(1, p(x)/q(x))`` and on
rejection ``p <- norm(max(p-q, 0))``; deterministic (e.g. top-k) siblings are point-mass
proposals: accepted with ``p(x)`` and on rejection ``p <- norm(p with x zeroed)``.
"""

from __future__ import annotations

import torch

from speclab.decoding.host import fetch
from speclab.decoding.rules.verdict import Verdict
from speclab.decoding.sampling import sample
from speclab.decoding.tree import SAMPLED, TokenTree


def _normalize(x: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    total = x.sum()
    return x / total if total > 0 else fallback


def verify_speculative(
    tree: TokenTree, p: torch.Tensor, generator: torch.Generator | None
) -> Verdict:
    """Lossless speculative sampling over a chain or a multi-branch tree.

    Args:
        tree: draft tree with ``T`` nodes; sampled children need ``tree.q_dist``.
        p: ``[T, V]`` warped target probabilities at every node (any device: read with
            the tree's ``q`` in ONE :func:`~speclab.decoding.host.fetch`).
        generator: source of randomness (seeded for reproducibility).
    """
    return speculative_on_host(tree, *fetch_speculative(tree, p), generator)


def speculative_inputs(tree: TokenTree, p: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What :func:`speculative_on_host` reads, still on the device: ``p`` ``[T, V]`` and
    the ``[V]`` proposal distribution of every sampled node (ascending node id)."""
    return (p, *(tree.q_dist[k] for k in sorted(tree.q_dist)))


def fetch_speculative(tree: TokenTree, p: torch.Tensor
                      ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """``p`` and the tree's ``q`` on the host (one fetch)."""
    host = fetch(*speculative_inputs(tree, p))
    return host[0], dict(zip(sorted(tree.q_dist), host[1:], strict=True))


def speculative_on_host(tree: TokenTree, p: torch.Tensor, q_dist: dict[int, torch.Tensor],
                        generator: torch.Generator | None) -> Verdict:
    """:func:`verify_speculative` over host tensors (``p`` ``[T, V]``; ``q_dist``: node ->
    ``[V]``): every read below is a host read, so the device is never waited for."""
    node, path, evaluated = 0, [0], 0
    while True:
        p_res = p[node]
        kids = tree.children[node]
        if not kids:
            return Verdict(path, sample(p_res, generator), evaluated)
        evaluated += 1
        sampled = tree.child_kind.get(node) == SAMPLED
        q = q_dist[node] if sampled else None
        nxt = -1
        for c in kids:
            x = tree.tokens[c]
            r = float(torch.rand((), generator=generator))
            if sampled:
                qx = float(q[x])
                if qx > 0 and r < min(1.0, float(p_res[x]) / qx):
                    nxt = c
                    break
                p_res = _normalize(torch.clamp(p_res - q, min=0.0), p_res)
            else:
                if r < float(p_res[x]):
                    nxt = c
                    break
                zeroed = p_res.clone()
                zeroed[x] = 0.0
                p_res = _normalize(zeroed, p_res)
        if nxt < 0:
            return Verdict(path, sample(p_res, generator), evaluated)
        node = nxt
        path.append(node)

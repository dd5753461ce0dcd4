"""Verification rules: pure functions of (tree, target scores, rng) -> accepted path + bonus.

``p`` is the target distribution at a node (over that node's children), ``q`` the draft's.

* :func:`verify_greedy` — exact match against the target argmax; lossless at temperature 0.
* :func:`verify_speculative` — speculative sampling (Leviathan et al. Algorithm 1 for a
  chain; recursive rejection over siblings for trees, SpecInfer-style). Lossless at any
  temperature when ``p`` and ``q`` were warped identically. Siblings drafted i.i.d. from
  ``q`` are accepted with ``min(1, p(x)/q(x))`` and on rejection ``p <- norm(max(p-q, 0))``;
  deterministic (e.g. top-k) siblings are point-mass proposals: accepted with ``p(x)``
  and on rejection ``p <- norm(p with x zeroed)``.
* :func:`verify_typical_relaxed` — Medusa typical acceptance: accept ``x`` if
  ``p(x) > min(epsilon, delta * exp(-H(p)))``. RELAXED: it changes the output distribution.
* :func:`verify_conditional` — AASD conditional verification (eq. 4-6): a node marked
  ``relaxed`` passes if ``p(x) >= min(alpha * H(p) + beta, max p)``, other nodes only if
  they are the argmax; the longest passing path wins. RELAXED: it changes outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speclab.decoding.sampling import SamplingParams, sample, warp_probs
from speclab.decoding.tree import SAMPLED, TokenTree


@dataclass
class Verdict:
    """Outcome of verifying one tree.

    ``path``: accepted node indices from the root (always starts with 0);
    ``bonus``: the token the target contributes after the last accepted node;
    ``evaluated``: how many depths had a draft token judged (for the acceptance rate).
    """

    path: list[int]
    bonus: int
    evaluated: int

    @property
    def accepted(self) -> int:
        """Number of accepted draft tokens."""
        return len(self.path) - 1


def verify_greedy(tree: TokenTree, target_logits: torch.Tensor) -> Verdict:
    """Follow the target's argmax through the tree.

    Args:
        tree: draft tree with ``T`` nodes.
        target_logits: ``[T, V]`` target logits at every node.
    """
    best = target_logits.argmax(-1).tolist()
    node, path, evaluated = 0, [0], 0
    while True:
        if tree.children[node]:
            evaluated += 1
        child = tree.find_child(node, best[node])
        if child < 0:
            return Verdict(path, best[node], evaluated)
        node = child
        path.append(node)


def _normalize(x: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    total = x.sum()
    return x / total if total > 0 else fallback


def verify_speculative(
    tree: TokenTree, p: torch.Tensor, generator: torch.Generator | None
) -> Verdict:
    """Lossless speculative sampling over a chain or a multi-branch tree.

    Args:
        tree: draft tree with ``T`` nodes; sampled children need ``tree.q_dist``.
        p: ``[T, V]`` warped target probabilities at every node.
        generator: source of randomness (seeded for reproducibility).
    """
    node, path, evaluated = 0, [0], 0
    while True:
        p_res = p[node]
        kids = tree.children[node]
        if not kids:
            return Verdict(path, sample(p_res, generator), evaluated)
        evaluated += 1
        sampled = tree.child_kind.get(node) == SAMPLED
        q = tree.q_dist[node] if sampled else None
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


def verify_typical_relaxed(
    tree: TokenTree,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    epsilon: float = 0.09,
    delta: float = 0.3,
) -> Verdict:
    """Medusa typical acceptance (RELAXED, not lossless at temperature > 0).

    Accept child ``x`` of a node when ``p(x) > min(epsilon, delta * exp(-H(p)))``; among
    passing siblings take the most probable; the bonus token is sampled from ``p``.
    At temperature 0 this is exactly :func:`verify_greedy`.

    Args:
        target_logits: ``[T, V]`` target logits at every node.
    """
    if params.greedy:
        return verify_greedy(tree, target_logits)
    p = warp_probs(target_logits, params)
    entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
    threshold = torch.clamp(delta * torch.exp(-entropy), max=epsilon)
    node, path, evaluated = 0, [0], 0
    while True:
        kids = tree.children[node]
        if kids:
            evaluated += 1
        passing = [c for c in kids if float(p[node, tree.tokens[c]]) > float(threshold[node])]
        if not passing:
            return Verdict(path, sample(p[node], generator), evaluated)
        node = max(passing, key=lambda c: float(p[node, tree.tokens[c]]))
        path.append(node)


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
    p = target_logits.float().softmax(-1)
    best = p.argmax(-1).tolist()
    limit = conditional_threshold(p, alpha, beta).tolist()

    def passes(child: int) -> bool:
        parent, tok = tree.parents[child], tree.tokens[child]
        if tok == best[parent]:
            return True
        return tree.relaxed[child] and float(p[parent, tok]) >= limit[parent]

    longest: list[int] = [0]
    stack = [[0]]
    while stack:  # depth-first over passing nodes; keep the longest path
        path = stack.pop()
        if len(path) > len(longest):
            longest = path
        stack.extend(path + [c] for c in tree.children[path[-1]] if passes(c))
    evaluated = sum(1 for n in longest if tree.children[n])
    return Verdict(longest, best[longest[-1]], evaluated)

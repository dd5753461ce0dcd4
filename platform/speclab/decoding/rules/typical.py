"""Medusa typical acceptance. RELAXED: it changes the output distribution at T > 0."""

from __future__ import annotations

import torch

from speclab.decoding.rules.greedy import verify_greedy
from speclab.decoding.rules.verdict import Verdict
from speclab.decoding.sampling import SamplingParams, sample, warp_probs
from speclab.decoding.tree import TokenTree


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

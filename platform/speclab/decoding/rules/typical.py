"""Medusa typical acceptance. RELAXED: it changes the output distribution at T > 0."""

from __future__ import annotations

import math

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

    A node ``x`` passes when ``p(x) > min(epsilon, delta * exp(-H(p)))`` under its
    parent's ``p``. As in Medusa, the LONGEST root path whose every node passes is
    accepted, ties broken by the path's likelihood (product of ``p``); the bonus token is
    sampled from ``p`` after it. At temperature 0 this is exactly :func:`verify_greedy`.

    Args:
        target_logits: ``[T, V]`` target logits at every node.
    """
    if params.greedy:
        return verify_greedy(tree, target_logits)
    p = warp_probs(target_logits, params)
    entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
    threshold = torch.clamp(delta * torch.exp(-entropy), max=epsilon)
    limit = threshold.tolist()
    best, best_key = [0], (0, 0.0)
    stack = [([0], 0.0)]  # (path, log-likelihood of its drafted tokens)
    while stack:  # depth-first over passing nodes
        path, logp = stack.pop()
        key = (len(path), logp)
        if key > best_key:
            best, best_key = path, key
        node = path[-1]
        for c in tree.children[node]:
            pc = float(p[node, tree.tokens[c]])
            if pc > limit[node]:
                stack.append((path + [c], logp + math.log(pc)))
    evaluated = sum(1 for n in best if tree.children[n])
    return Verdict(best, sample(p[best[-1]], generator), evaluated)

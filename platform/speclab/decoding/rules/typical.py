"""Medusa typical acceptance. RELAXED: it changes the output distribution at T > 0."""

from __future__ import annotations

import math

import torch

from speclab.decoding.host import fetch
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
    bonus: str = "greedy",
) -> Verdict:
    """Medusa typical acceptance (RELAXED, not lossless at temperature > 0).

    A node ``x`` passes when ``p(x) > min(epsilon, delta * exp(-H(p)))`` under its
    parent's ``p = softmax(logits / T)`` (the temperature alone, as Medusa's
    ``evaluate_posterior``: top-k / top-p do not enter the criterion). As in Medusa, the
    LONGEST root path whose every node passes is accepted, ties broken by the path's
    likelihood (product of ``p``). The bonus token after it is the target's argmax
    (``bonus="greedy"``, Medusa's choice) or a draw from the request's warped
    distribution (``bonus="sample"``, a variant). At temperature 0 this is exactly
    :func:`verify_greedy`.

    Args:
        target_logits: ``[T, V]`` target logits at every node.
    """
    if params.greedy:
        return verify_greedy(tree, target_logits)
    host = fetch(*typical_inputs(target_logits, params, bonus))
    return typical_on_host(tree, host[0], generator, epsilon, delta, *host[1:])


def typical_inputs(target_logits: torch.Tensor, params: SamplingParams, bonus: str
                   ) -> tuple[torch.Tensor, ...]:
    """What :func:`typical_on_host` reads at temperature > 0, on the logits' device:
    ``softmax(logits / T)`` ``[T, V]`` and, for ``bonus="sample"``, the request's warped
    distribution ``[T, V]`` the bonus is drawn from."""
    if bonus not in ("greedy", "sample"):
        raise ValueError(f"verify_params (typical): bonus must be 'greedy' or 'sample', got "
                         f"{bonus!r}")
    p = warp_probs(target_logits, SamplingParams(params.temperature))
    return (p,) if bonus == "greedy" else (p, warp_probs(target_logits, params))


def typical_on_host(tree: TokenTree, p: torch.Tensor, generator: torch.Generator | None,
                    epsilon: float, delta: float, bonus_probs: torch.Tensor | None = None
                    ) -> Verdict:
    """:func:`verify_typical_relaxed` at temperature > 0 on the host: ``p`` ``[T, V]`` the
    temperature-only distribution; ``bonus_probs`` ``[T, V]`` the distribution the bonus
    is drawn from (None: the bonus is the argmax of ``p``)."""
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
    last = best[-1]
    token = int(p[last].argmax()) if bonus_probs is None else sample(bonus_probs[last], generator)
    return Verdict(best, token, evaluated)

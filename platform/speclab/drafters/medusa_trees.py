"""Medusa tree templates: which head predictions a round verifies (pure Python).

A template is a list of RANK PATHS: ``(r_1, ..., r_d)`` is the depth-``d`` node that
takes head 1's ``r_1``-th best token, then head 2's ``r_2``-th, ..., head ``d``'s
``r_d``-th (ranks from 0). Every prefix of a path is in the template, listed before it,
so a tree is built parent-first by walking the list. Three shapes (the slides' ladder):

* :func:`chain_template` — heads without a tree: each head's top-1, one path;
* :func:`cartesian_template` — the Cartesian product of each head's top-``s`` tokens
  (``sum_k s^k`` nodes, the slides' "Tree attention" page);
* :func:`sparse_template` — Medusa's optimised sparse tree: the ``nodes`` paths with the
  highest estimated acceptance probability ``prod_j acc[j][r_j]``, from the heads'
  measured top-``r`` accuracies (:func:`speclab.models.medusa.head_accuracies`), under the
  independence assumption Medusa makes. A path's estimate is never above its parent's,
  so taking paths best first keeps every parent.

:func:`expected_length` is a template's estimated tokens per round under those accuracies.
"""

from __future__ import annotations

import heapq
import itertools

Template = list[tuple[int, ...]]


def chain_template(depth: int) -> Template:
    """Each head's best token, ``depth`` levels deep."""
    return [(0,) * d for d in range(1, depth + 1)]


def cartesian_template(top: int, depth: int) -> Template:
    """Every combination of the heads' ``top`` best tokens, ``depth`` levels deep."""
    return [p for d in range(1, depth + 1) for p in itertools.product(range(top), repeat=d)]


def sparse_template(acc: list[list[float]], nodes: int, depth: int | None = None) -> Template:
    """The ``nodes`` rank paths of highest ``prod_j acc[j][r_j]`` (at most ``depth``
    levels; default: one per head), parent-first, ties broken by the path itself.

    ``acc[k][r]``: probability that head ``k + 1``'s ``r``-th best token is right."""
    if not acc or not acc[0]:
        raise ValueError("sparse tree: needs the heads' measured accuracies")
    depth = len(acc) if depth is None else min(depth, len(acc))
    heap = [(-acc[0][r], (r,)) for r in range(len(acc[0]))]
    heapq.heapify(heap)
    out: Template = []
    while heap and len(out) < nodes:
        neg, path = heapq.heappop(heap)
        out.append(path)
        if len(path) < depth:
            for r, a in enumerate(acc[len(path)]):
                heapq.heappush(heap, (neg * a, path + (r,)))
    return sorted(out, key=lambda p: (len(p), p))


def expected_length(template: Template, acc: list[list[float]]) -> float:
    """Estimated tokens per round: 1 (the bonus) + the sum of every node's estimate."""
    total = 1.0
    for path in template:
        value = 1.0
        for j, r in enumerate(path):
            value *= acc[j][r] if r < len(acc[j]) else 0.0
        total += value
    return total

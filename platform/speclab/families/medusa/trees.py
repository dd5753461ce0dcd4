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
  measured top-``r`` accuracies (:func:`speclab.families.medusa.model.head_accuracies`), under the
  independence assumption Medusa makes. A path's estimate is never above its parent's,
  so taking paths best first keeps every parent.

:func:`expected_length` is a template's estimated tokens per round under those accuracies
(Medusa's estimate: independent heads); :func:`replayed_length` is the same figure
replayed on calibration positions, with the heads' joint behaviour.
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


def replayed_length(template: Template, sequences: list[list[tuple[int, ...]]]) -> float:
    """Tokens per round the template gives when its rounds are replayed on calibration
    sequences, as greedy decoding runs them: ``sequences[i][j][k]`` is the rank of the
    right token among head ``k + 1``'s predictions at the ``j``-th position of sequence
    ``i`` (the first position: its first round's; any rank outside the template when
    the right token is not among them). A round at position ``j`` accepts ``d_j``
    drafts, the depth of the deepest template path that is a prefix of the ranks there
    (siblings take different tokens, so at most one path per depth is right; a
    template holds every prefix of its paths), commits ``d_j + 1`` tokens, and the next
    round starts at ``j + d_j + 1``. Returns committed tokens / rounds over every
    sequence (1.0 for none). Unlike :func:`expected_length` it assumes no independence
    between the heads, and unlike a mean over all positions it weighs positions as
    rounds meet them (a long accepted run is one round, not many)."""
    paths = set(template)
    tokens = rounds = 0
    for ranks in sequences:
        j = 0
        while j < len(ranks):
            r, d = ranks[j], 0
            while d < len(r) and r[: d + 1] in paths:
                d += 1
            tokens, rounds, j = tokens + d + 1, rounds + 1, j + d + 1
    return tokens / rounds if rounds else 1.0

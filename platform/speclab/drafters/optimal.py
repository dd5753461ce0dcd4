"""Optimal tree search with optional SALF stopping (SALF/TALF paper, Algorithm 2).

``G`` (capacity ``nodes + 1`` including the root) holds the best nodes found so far;
``Q`` (capacity ``nodes``) holds unexpanded candidates. Each iteration pops the ``batch``
best candidates, moves them to ``G``, drops those that cannot stay in ``G`` (``pr <= eps``),
and expands the rest in ONE draft forward. Without stopping (``threshold = 0``) the
result is exactly the top-``nodes`` nodes by path probability (Theorems 2-3). SALF
stops once the summed probability ``S_i`` of the nodes about to be expanded falls
below ``threshold``; ``S_i`` strictly decreases (Theorem 1).

Ties in path probability are broken by insertion order (earlier ranks higher), so a
parent always outranks its children and ``G`` stays a connected tree.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field, model_validator

from speclab.decoding.drafting import TopChildren, TreeSteps, run_steps, top_children
from speclab.decoding.runner import ModelRunner
from speclab.decoding.tree import DETERMINISTIC, TokenTree, select_subtree
from speclab.drafters.base import ModelDrafter
from speclab.drafters.batched import BatchTreeDrafter
from speclab.drafters.eagle2 import ExpandFn
from speclab.drafters.knobs import TreeKnobs

#: a candidate: ``(-path_prob, insertion order, parent, token, q)``; plain tuples sort in C
#: by their first two fields (smaller is better; the order is unique, so ties end there)
_Cand = tuple[float, int, int, int, float]


@dataclass
class OptimalTreeResult:
    """The drafted tree, the map work-index -> tree-index, and the sums ``S_i``."""

    tree: TokenTree
    old_to_new: dict[int, int]
    sums: list[float]


def build_optimal_tree(
    root_token: int,
    root_probs: torch.Tensor | TopChildren,
    expand: ExpandFn,
    nodes: int,
    batch: int,
    threshold: float = 0.0,
    max_depth: int = 64,
) -> OptimalTreeResult:
    """Algorithm 2 (SALF when ``threshold > 0``).

    Args:
        root_token: the root's token.
        root_probs: ``[V]`` draft distribution over the root's children.
        expand: ``expand(tree, node_ids) -> [len(node_ids), V]`` draft probabilities.
        nodes: N, the number of draft nodes (root excluded).
        batch: B, nodes expanded per draft forward.
        threshold: SALF threshold ``th`` in [0, 1); 0 disables stopping.
        max_depth: nodes at this depth are not expanded.
    """
    steps = optimal_tree_steps(root_token, root_probs, nodes, batch, threshold, max_depth)
    sums: list[float] = []

    def keep_sums():  # the same builder, returning the tree and map (run_steps' shape)
        res = yield from steps
        sums.extend(res.sums)
        return res.tree, res.old_to_new

    tree, old_to_new = run_steps(keep_sums(), expand)
    return OptimalTreeResult(tree, old_to_new, sums)


def optimal_tree_steps(
    root_token: int,
    root_probs: torch.Tensor | TopChildren,
    nodes: int,
    batch: int,
    threshold: float = 0.0,
    max_depth: int = 64,
) -> Generator[tuple[TokenTree, list[int]], torch.Tensor, OptimalTreeResult]:
    """:func:`build_optimal_tree` as a generator, so many trees can grow in lockstep with
    batched draft forwards: it yields ``(work_tree, node_ids)`` to expand, receives their
    ``[len(node_ids), V]`` draft probabilities, and returns the result."""
    if not 1 <= batch <= nodes:
        raise ValueError(f"batch: must be in [1, nodes={nodes}], got {batch}")
    work = TokenTree(root_token)
    order = 0
    rank: dict[int, tuple[float, int]] = {0: (-1.0, -1)}
    in_g: list[int] = [0]
    queue: list[_Cand] = []
    sums: list[float] = []

    def push_children(node: int, top: TopChildren, row: int) -> None:
        nonlocal order
        work.set_children_kind(node, DETERMINISTIC)
        pr = work.path_prob[node]
        for v, t in top.row(row, nodes):
            order += 1
            queue.append((-pr * v, order, node, t, v))

    sums.append(1.0)  # iteration 0 expands the root alone (pr = 1)
    push_children(0, top_children(root_probs, nodes), 0)
    queue.sort()
    del queue[nodes:]
    while queue:
        popped = queue[:batch]
        del queue[:batch]
        chosen = []
        for neg_pr, at, parent, token, q in popped:
            idx = work.add(token, parent, q)
            rank[idx] = (neg_pr, at)
            in_g.append(idx)
            chosen.append(idx)
        in_g.sort(key=rank.__getitem__)
        del in_g[nodes + 1 :]
        eps_key = rank[in_g[-1]] if len(in_g) == nodes + 1 else None
        # line 12: keep nodes with pr > eps (G's minimum), i.e. strictly above G's last entry
        expandable = [i for i in chosen if eps_key is None or rank[i] < eps_key]
        s_i = sum(work.path_prob[i] for i in expandable)
        sums.append(s_i)
        if threshold > 0 and s_i < threshold:
            break
        expandable = [i for i in expandable if work.depths[i] < max_depth]
        if expandable:
            top = top_children((yield work, expandable), nodes)
            for row, node in enumerate(expandable):
                push_children(node, top, row)
            queue.sort()
            del queue[nodes:]
        if queue and eps_key is not None and queue[0][:2] > eps_key:
            break  # G is full and no candidate left can enter it
    tree, old_to_new = select_subtree(work, in_g)
    return OptimalTreeResult(tree, old_to_new, sums)


def optimal_steps(nodes: int, batch: int, threshold: float, depth: int
                  ) -> Callable[[int, TopChildren, int, int], TreeSteps]:
    """A batched drafter's ``steps(root, probs, budget, deeper)`` for optimal / SALF
    trees (``threshold`` 0: never stop early): at most ``budget`` levels of ``depth``,
    ``deeper`` beyond it (drafting ahead)."""
    def steps(root: int, probs: TopChildren, budget: int, deeper: int = 0) -> TreeSteps:
        res = yield from optimal_tree_steps(root, probs, nodes, batch, threshold,
                                            min(depth + deeper, max(budget, 1)))
        return res.tree, res.old_to_new

    return steps


class OptimalTreeDrafter(ModelDrafter):
    """Optimal-tree / SALF drafting with a draft LM (nodes ranked by :meth:`score_probs`)."""

    def __init__(
        self,
        runner: ModelRunner,
        nodes: int,
        batch: int,
        threshold: float = 0.0,
        depth: int = 64,
        score_temperature: float = 1.0,
    ) -> None:
        self.check_knobs(nodes, batch, threshold, depth, score_temperature)
        super().__init__(runner)
        self.nodes, self.batch, self.threshold, self.depth = nodes, batch, threshold, depth
        self.score_temperature = score_temperature
        self.name = "salf" if threshold > 0 else "optimal"
        self.last_sums: list[float] = []

    @staticmethod
    def check_knobs(nodes: int, batch: int, threshold: float, depth: int,
                    score_temperature: float) -> None:
        """ValueError naming the first knob out of range."""
        if score_temperature <= 0:
            raise ValueError(f"score_temperature: must be > 0, got {score_temperature}")
        if nodes < 1:
            raise ValueError(f"nodes: must be >= 1, got {nodes}")
        if not 1 <= batch <= nodes:
            raise ValueError(f"batch: must be in [1, nodes={nodes}], got {batch}")
        if not 0.0 <= threshold < 1.0:
            raise ValueError(f"threshold: must be in [0, 1), got {threshold}")
        if depth < 1:
            raise ValueError(f"depth: must be >= 1, got {depth}")

    def propose(self, committed: list[int], budget: int) -> TokenTree:
        st = self.score_temperature
        res = build_optimal_tree(
            committed[-1],
            self.score_probs(self.sync(committed), st),
            lambda t, ns: self.score_probs(self.expand(t, ns), st),
            self.nodes,
            self.batch,
            self.threshold,
            min(self.depth, max(budget, 1)),
        )
        self.last_sums = res.sums
        self.slot = {res.old_to_new[o]: s for o, s in self.slot.items() if o in res.old_to_new}
        return res.tree


class OptimalConfig(TreeKnobs):
    """``optimal``: the optimal draft tree (SALF Algorithm 2 without stopping)."""

    name: Literal["optimal"] = "optimal"
    batch: int = Field(4, gt=0, description="nodes expanded per draft forward (optimal/SALF)")

    @model_validator(mode="after")
    def _batch_within_nodes(self):
        if self.batch > self.nodes:
            raise ValueError(f"batch ({self.batch}) must not exceed nodes ({self.nodes})")
        return self

    def stop_threshold(self) -> float:
        """SALF's stopping threshold (0: never stop early)."""
        return 0.0

    def build(self, ctx) -> OptimalTreeDrafter:
        return OptimalTreeDrafter(ctx.draft, self.nodes, self.batch, self.stop_threshold(),
                                  self.depth, self.score_temperature)

    def build_batch(self, ctx) -> BatchTreeDrafter:
        OptimalTreeDrafter.check_knobs(self.nodes, self.batch, self.stop_threshold(),
                                       self.depth, self.score_temperature)

        steps = optimal_steps(self.nodes, self.batch, self.stop_threshold(), self.depth)
        return BatchTreeDrafter(ctx.make_batch_runner(), self.name, steps, self.nodes,
                                self.score_temperature)


class SalfConfig(OptimalConfig):
    """``salf``: SALF, the optimal tree that stops growing when further gains fall below
    ``salf_threshold``."""

    renamed = {"threshold": "salf_threshold"}
    name: Literal["salf"] = "salf"
    salf_threshold: float = Field(0.3, gt=0.0, lt=1.0,
                                  description="SALF stopping threshold th, in (0, 1)")

    def stop_threshold(self) -> float:
        return self.salf_threshold

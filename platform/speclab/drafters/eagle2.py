"""EAGLE-2 dynamic draft tree: beam expansion by path probability, then top-N rerank.

At each of ``depth`` levels the ``top_k`` most probable nodes of the newest level (by
path probability, the product of draft probabilities from the root) are expanded in
ONE draft forward with tree attention; each contributes its ``top_k`` children. Finally
the ``nodes`` most probable nodes of all candidates are kept (a node's path probability
never exceeds its parent's, so the kept set is a connected tree).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from pydantic import Field

from speclab.decoding.drafting import TopChildren, TreeSteps, run_steps, top_children
from speclab.decoding.runner import ModelRunner
from speclab.decoding.tree import DETERMINISTIC, TokenTree, select_subtree
from speclab.drafters.base import ModelDrafter
from speclab.drafters.batched import BatchTreeDrafter
from speclab.drafters.knobs import TreeKnobs

ExpandFn = Callable[[TokenTree, list[int]], torch.Tensor | TopChildren]


def _add_top_children(tree: TokenTree, node: int, top: TopChildren, row: int,
                      k: int) -> list[int]:
    tree.set_children_kind(node, DETERMINISTIC)
    return [tree.add(t, node, v) for v, t in top.row(row, k)]


def build_eagle2_tree(
    root_token: int,
    root_probs: torch.Tensor,
    expand: ExpandFn,
    top_k: int,
    depth: int,
    nodes: int,
) -> tuple[TokenTree, dict[int, int]]:
    """Build an EAGLE-2 tree.

    Args:
        root_token: the root's token.
        root_probs: ``[V]`` draft distribution over the root's children.
        expand: ``expand(tree, node_ids) -> [len(node_ids), V]`` draft probabilities.
        top_k: children per expanded node and nodes expanded per level.
        depth: maximum depth of drafted tokens.
        nodes: number of draft nodes kept after reranking.
    Returns:
        The kept tree and the map from candidate-tree index to kept-tree index.
    """
    return run_steps(eagle2_tree_steps(root_token, root_probs, top_k, depth, nodes), expand)


def eagle2_tree_steps(root_token: int, root_probs: torch.Tensor | TopChildren, top_k: int,
                      depth: int,
                      nodes: int) -> TreeSteps:
    """:func:`build_eagle2_tree` as a generator (see :data:`~speclab.decoding.drafting.
    TreeSteps`), so many rows' trees grow in lockstep with batched draft forwards."""
    work = TokenTree(root_token)
    frontier = _add_top_children(work, 0, top_children(root_probs, top_k), 0, top_k)
    for _ in range(depth - 1):
        frontier = sorted(frontier, key=lambda i: -work.path_prob[i])[:top_k]
        top = top_children((yield work, frontier), top_k)
        level = []
        for row, node in enumerate(frontier):
            level += _add_top_children(work, node, top, row, top_k)
        frontier = level
    # rerank: ties broken towards earlier (shallower) nodes so parents precede children
    order = sorted(range(1, len(work)), key=lambda i: (-work.path_prob[i], i))[:nodes]
    return select_subtree(work, [0, *order])


def eagle2_steps(top_k: int, depth: int, nodes: int
                 ) -> Callable[[int, TopChildren, int, int], TreeSteps]:
    """A batched drafter's ``steps(root, probs, budget, deeper)`` for EAGLE-2 trees: at
    most ``budget`` levels of ``depth``, ``deeper`` beyond it (drafting ahead)."""
    def steps(root: int, probs: TopChildren, budget: int, deeper: int = 0) -> TreeSteps:
        return eagle2_tree_steps(root, probs, top_k, min(depth + deeper, max(budget, 1)),
                                 nodes)

    return steps


class Eagle2TreeDrafter(ModelDrafter):
    """EAGLE-2 tree drafting with a draft LM (nodes ranked by :meth:`score_probs`)."""

    name = "tree"

    def __init__(
        self, runner: ModelRunner, top_k: int, depth: int, nodes: int,
        score_temperature: float = 1.0,
    ) -> None:
        for field, v in (("top_k", top_k), ("depth", depth), ("nodes", nodes)):
            if v < 1:
                raise ValueError(f"{field}: must be >= 1, got {v}")
        if score_temperature <= 0:
            raise ValueError(f"score_temperature: must be > 0, got {score_temperature}")
        super().__init__(runner)
        self.top_k, self.depth, self.nodes = top_k, depth, nodes
        self.score_temperature = score_temperature

    def propose(self, committed: list[int], budget: int) -> TokenTree:
        st = self.score_temperature
        tree, old_to_new = build_eagle2_tree(
            committed[-1],
            self.score_probs(self.sync(committed), st),
            lambda t, ns: self.score_probs(self.expand(t, ns), st),
            self.top_k,
            min(self.depth, max(budget, 1)),
            self.nodes,
        )
        self.slot = {old_to_new[o]: s for o, s in self.slot.items() if o in old_to_new}
        return tree


class TreeConfig(TreeKnobs):
    """``tree``: EAGLE-2 dynamic draft tree (expand the best ``tree_top_k`` per level)."""

    renamed = {"top_k": "tree_top_k"}
    name: Literal["tree"] = "tree"
    tree_top_k: int = Field(4, gt=0, description="EAGLE-2 children per node / beam width")

    def build(self, ctx) -> Eagle2TreeDrafter:
        return Eagle2TreeDrafter(ctx.draft, self.tree_top_k, self.depth, self.nodes,
                                 self.score_temperature)

    def build_batch(self, ctx) -> BatchTreeDrafter:
        return BatchTreeDrafter(ctx.make_batch_runner(), "tree",
                                eagle2_steps(self.tree_top_k, self.depth, self.nodes),
                                self.tree_top_k, self.score_temperature)

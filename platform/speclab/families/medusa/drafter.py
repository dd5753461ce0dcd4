"""Medusa: draft trees from heads on the target's own last feature (method ``medusa``).

The heads (:class:`~speclab.families.medusa.model.MedusaHeads`) read ONE vector per round: the
target's feature at the last accepted node, the one whose LM head produced the bonus
token that is now the root. Head ``k`` on it predicts the token ``k`` levels below the
root. There is no draft model forward: one call of the ``K`` small heads, then the
round's tree is a fixed template of rank paths (:mod:`speclab.families.medusa.trees`)
filled with each head's ranked tokens: ``tree: chain`` (each head's top-1), ``cartesian``
(top-``tree_top_k`` of every head combined) or ``sparse`` (the ``nodes`` paths with the
highest acceptance estimated from the heads' calibration, stored with them in
``tree.json``). The target verifies the tree in one forward and returns the features of
the accepted path (:meth:`MedusaDrafter.observe`), which feed the next round's heads.

Children are deterministic proposals (ranked, not sampled), so greedy and speculative
sampling stay lossless; ``verify: typical`` (Medusa's typical acceptance) is relaxed.
"""

from __future__ import annotations

import os
import time
from typing import Any, Literal

import torch
from pydantic import Field, field_validator

from speclab.config.method import MethodSpec
from speclab.decoding.tree import DETERMINISTIC, TokenTree
from speclab.drafters.base import Drafter
from speclab.families.medusa.model import MedusaHeads, load_medusa, target_fingerprint
from speclab.families.medusa.trees import (
    Template,
    cartesian_template,
    chain_template,
    sparse_template,
)
from speclab.models.loading import registry_or_folder

TreeShape = Literal["sparse", "cartesian", "chain"]


def medusa_template(heads: MedusaHeads, tree: TreeShape, nodes: int, top: int,
                    depth: int = 0) -> Template:
    """The rank-path template of ``tree`` for ``heads`` (``depth`` 0: one level per head);
    ``sparse`` needs the heads' calibration (``heads.tree``, from ``tree.json``)."""
    depth = heads.meta.heads if depth <= 0 else min(depth, heads.meta.heads)
    if tree == "chain":
        return chain_template(depth)
    if tree == "cartesian":
        return cartesian_template(top, depth)
    if not heads.tree or "accuracies" not in heads.tree:
        raise ValueError("medusa_model: these heads have no calibration (tree.json with "
                         "accuracies) for tree: sparse; use tree: cartesian or chain, or "
                         "heads written by jobs.train_medusa")
    return sparse_template(heads.tree["accuracies"], nodes, depth)


class MedusaDrafter(Drafter):
    """Tree drafting with Medusa heads (see the module docstring)."""

    name = "medusa"

    def __init__(self, heads: MedusaHeads, template: Template) -> None:
        if not template:
            raise ValueError("medusa: the tree template is empty")
        self.heads = heads
        self.template = template
        self.ranks = max(r for path in template for r in path) + 1
        self.last: torch.Tensor | None = None
        self._calls, self._seconds = 0, 0.0

    @property
    def calls(self) -> int:
        return self._calls

    @property
    def seconds(self) -> float:
        return self._seconds

    def reset(self) -> None:
        self.last = None

    def observe(self, features: torch.Tensor) -> None:
        """Keep the last row of the target's features ``[n, H]`` (the heads' input)."""
        hidden = self.heads.meta.hidden_size
        if features.ndim != 2 or features.shape[-1] != hidden:
            raise ValueError(f"medusa_model: the heads expect target features of width "
                             f"{hidden}, got shape {tuple(features.shape)}")
        if features.shape[0]:
            self.last = features[-1].float()

    def accept(self, tree: TokenTree, path: list[int]) -> None:
        """Nothing to prune: the heads keep no cache."""

    @torch.no_grad()
    def propose(self, committed: list[int], budget: int) -> TokenTree:
        tree = TokenTree(committed[-1])
        if self.last is None:  # a 1-token prompt: no feature yet, the target goes first
            return tree
        t0 = time.perf_counter()
        logits = self.heads(self.last.to(self.heads.w1.device))  # [K, V]
        probs = logits.float().softmax(-1)
        top_p, top_i = probs.topk(min(self.ranks, probs.shape[-1]), dim=-1)  # [K, ranks]
        top_p, top_i = top_p.cpu().tolist(), top_i.cpu().tolist()
        self._calls += 1
        self._seconds += time.perf_counter() - t0
        node_of: dict[tuple[int, ...], int] = {(): 0}
        for path in self.template:
            level, rank = len(path) - 1, path[-1]
            if level >= budget or rank >= len(top_i[level]):
                continue
            parent = node_of.get(path[:-1])
            if parent is None:
                continue
            if not tree.children[parent]:
                tree.set_children_kind(parent, DETERMINISTIC)
            node_of[path] = tree.add(top_i[level][rank], parent, top_p[level][rank])
        return tree


class MedusaConfig(MethodSpec):
    """``medusa``: Medusa heads (``medusa_model``) drafting a ``chain``, ``cartesian`` or
    calibrated ``sparse`` tree from the target's last feature."""

    name: Literal["medusa"] = "medusa"
    needs_features = True  # the drafter reads the target's last-layer features
    needs_draft_model = False  # the heads are their own folder, not models.draft
    medusa_model: Any = Field(None, validate_default=True,
                              description="Medusa heads: a speclab or Medusa-format folder, or a "
                              "models:/ URI")
    tree: TreeShape = Field("sparse", description="sparse (calibrated), cartesian or chain")
    nodes: int = Field(32, gt=0, description="draft nodes of the sparse tree")
    tree_top_k: int = Field(2, gt=0, description="cartesian tree: tokens per head")
    depth: int = Field(0, ge=0, description="levels (heads) used; 0: every head")

    def draft_length(self) -> int | None:
        return self.depth or None  # 0: every head, known once the heads are loaded

    @field_validator("medusa_model")
    @classmethod
    def _given(cls, v: Any) -> Any:
        if v is None or v == "":
            raise ValueError("method 'medusa' needs heads (--medusa-model DIR or "
                             "models:/ URI)")
        if isinstance(v, os.PathLike):
            return os.fspath(v)
        if not isinstance(v, str | MedusaHeads):
            raise ValueError(f"must be a folder or models:/ URI, got {type(v).__name__}")
        return v

    def build(self, ctx) -> MedusaDrafter:
        heads = self.medusa_model
        if not isinstance(heads, MedusaHeads):
            heads = ctx.cached(("medusa", heads), lambda: load_medusa(
                registry_or_folder(self.medusa_model, "medusa_model"), dtype=ctx.dtype,
                device=ctx.device, target_config=ctx.target_config,
                target=ctx.target_model))  # speclab's or Medusa's format (legacy
            # "version 2" heads copy the target's LM head), where the target's features are
        if ctx.target_model is not None:  # the target's hash once per Decoder, not per call
            heads.meta.check_target(ctx.target_model, fingerprint=ctx.cached(
                "target_fingerprint", lambda: target_fingerprint(ctx.target_model)))
        return MedusaDrafter(heads, medusa_template(heads, self.tree, self.nodes,
                                                    self.tree_top_k, self.depth))

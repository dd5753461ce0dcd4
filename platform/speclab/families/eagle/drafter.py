"""EAGLE: draft trees from the target's own features (method ``eagle``).

The drafter (:class:`~speclab.families.eagle.model.EagleModel`) runs over PAIRS ``(f_j, x_{j+1})``:
the target's feature at committed position ``j`` and the token after it. Pair ``j`` sits
at cache index and position ``j``; its output ``f_hat_{j+1}`` gives the distribution of
``x_{j+2}`` through the target's LM head. With ``n`` committed tokens the target has
produced features for positions ``0..n-2`` (the root ``x_{n-1}`` is processed by the next
verify), so the root's pair is ``(f_{n-2}, x_{n-1})`` and its output drafts the root's
children. Inside the tree a node's pair is ``(f_hat of its parent, its token)`` at
position ``base - 1 + depth``, expanded with tree attention like any draft LM.

After verification the drafter's cache is cropped back to the committed pairs: the
accepted tokens are re-processed next round with the TARGET's features of the accepted
path (:meth:`EagleDrafter.observe`), which is what EAGLE trains on. Drafting ahead
(:mod:`speclab.decoding.lookahead`: the next round drafted on a guessed verdict while the
target verifies) has no target features for the guessed path yet: the drafter's own
outputs at the path's nodes stand in for them, and :meth:`EagleDrafter.rewind` drops
those pairs once the target's features arrive. The tree itself is
EAGLE-2's dynamic tree (``builder: eagle2``, reranked by the drafter's confidence) or the
optimal tree / SALF (``builder: optimal | salf``), the builders the draft-LM methods use.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import torch
from pydantic import Field, field_validator

from speclab.decoding.runner import ModelRunner, tree_node_inputs
from speclab.decoding.tree import TokenTree
from speclab.drafters.base import Drafter
from speclab.drafters.eagle2 import build_eagle2_tree
from speclab.drafters.knobs import TreeKnobs
from speclab.drafters.optimal import build_optimal_tree
from speclab.families.eagle.model import is_eagle_model, load_eagle
from speclab.models.loading import registry_or_folder

Builder = Literal["eagle2", "optimal", "salf"]


class EagleDrafter(Drafter):
    """Tree drafting with an EAGLE feature drafter (see the module docstring)."""

    name = "eagle"

    def __init__(self, model: torch.nn.Module, top_k: int, depth: int, nodes: int,
                 score_temperature: float = 1.0, builder: Builder = "eagle2", batch: int = 4,
                 threshold: float = 0.0) -> None:
        for field, v in (("tree_top_k", top_k), ("depth", depth), ("nodes", nodes),
                         ("batch", batch)):
            if v < 1:
                raise ValueError(f"{field}: must be >= 1, got {v}")
        if score_temperature <= 0:
            raise ValueError(f"score_temperature: must be > 0, got {score_temperature}")
        self.runner = ModelRunner(model)
        self.hidden = model.meta.feature_width  # [k * H] for EAGLE-3's fused features
        self.top_k, self.depth, self.nodes = top_k, depth, nodes
        self.score_temperature, self.builder = score_temperature, builder
        self.batch, self.threshold = min(batch, nodes), threshold
        self.pending = torch.zeros(0, self.hidden)
        self.base = 0
        self.hid: dict[int, torch.Tensor] = {}  # the last tree's node -> drafter output
        self.guess: list[torch.Tensor] | None = None  # stand-ins for an accepted path's

    rewindable = True

    @property
    def calls(self) -> int:
        return self.runner.calls

    @property
    def seconds(self) -> float:
        return self.runner.seconds

    def reset(self) -> None:
        self.runner.reset()
        self.pending = torch.zeros(0, self.hidden)
        self.base = 0
        self.hid, self.guess = {}, None

    def rewind(self, keep: int) -> None:
        """Keep the pairs of the first ``keep`` committed tokens (at most ``keep - 1``) and
        the pending features still owed for them; the pairs processed with the drafter's
        own features in place of the target's (drafting ahead) go."""
        self.runner.crop(min(self.runner.length, max(keep - 1, 0)))
        self.pending = self.pending[:max(keep - 1 - self.runner.length, 0)]
        self.base = self.runner.length
        self.hid, self.guess = {}, None

    def observe(self, features: torch.Tensor) -> None:
        """Queue the target's features ``[n, F]`` of the next committed positions (``F``:
        ``H``, or ``k * H`` fused layers for EAGLE-3)."""
        self.pending = torch.cat([self.pending, checked_features(features, self.hidden)])

    def accept(self, tree: TokenTree, path: list[int]) -> None:
        self.runner.crop(self.base)  # accepted nodes return with the target's features
        # until they do (drafting ahead on a guessed verdict), the drafter's own outputs
        # at the root and the path's inner nodes predict them
        if all(node in self.hid for node in (0, *path[1:-1])):
            self.guess = [self.hid[node] for node in (0, *path[1:-1])]

    def _run(self, features: torch.Tensor, tokens: torch.Tensor,
             positions: torch.Tensor | None = None, allowed: torch.Tensor | None = None,
             last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, F]`` features + ``[T]`` tokens -> (``f_hat [T, H]``, ``probs [T, V]``;
        ``[1, V]``, the last token's, with ``last_only``: a catch-up over a prompt reads
        no other, and its full ``[T, V]`` softmax over SmolLM2's vocabulary was 200 MB)."""
        extra = {"logits_to_keep": 1} if last_only else {}
        f_hat, logits = self.runner.run(tokens, positions, allowed,
                                        features=features.to(self.runner.device)[None],
                                        **extra)
        return f_hat[0], (logits[0].float() / self.score_temperature).softmax(-1)

    def propose(self, committed: list[int], budget: int) -> TokenTree:
        n, m = len(committed), self.runner.length
        guess, self.guess = self.guess, None
        self.pending = owed_features(self.pending, guess, n, m)
        if not len(self.pending):  # a 1-token prompt: no target feature yet, target first
            self.hid = {}
            return TokenTree(committed[-1])
        tokens = torch.tensor(committed[m + 1: n], dtype=torch.long)
        f_hat, probs = self._run(self.pending, tokens, last_only=True)
        self.pending = torch.zeros(0, self.hidden)
        self.base = self.runner.length
        hid: dict[int, torch.Tensor] = {0: f_hat[-1]}
        slot = {0: self.base - 1}

        def expand(tree: TokenTree, nodes: list[int]) -> torch.Tensor:
            toks, pos, allowed = tree_node_inputs(self.runner.length, tree, nodes, self.base,
                                                  slot)
            feats = torch.stack([hid[tree.parents[i]] for i in nodes])
            out, p = self._run(feats, toks, pos, allowed)
            for row, node in enumerate(nodes):
                hid[node] = out[row]
            return p

        depth = min(self.depth, max(budget, 1))
        if self.builder == "eagle2":
            tree, old_to_new = build_eagle2_tree(committed[-1], probs[-1], expand, self.top_k,
                                                 depth, self.nodes)
        else:
            threshold = self.threshold if self.builder == "salf" else 0.0
            res = build_optimal_tree(committed[-1], probs[-1], expand, self.nodes, self.batch,
                                     threshold, depth)
            tree, old_to_new = res.tree, res.old_to_new
        self.hid = {old_to_new[o]: h for o, h in hid.items() if o in old_to_new}
        return tree


def checked_features(features: torch.Tensor, width: int) -> torch.Tensor:
    """The target's features ``[n, F]`` for a drafter reading ``F = width`` (``H``, or
    ``k * H`` fused layers for EAGLE-3), as float32 on the CPU; ValueError naming
    ``eagle_model`` for another shape (a drafter trained for another target)."""
    if features.ndim != 2 or features.shape[-1] != width:
        raise ValueError(f"eagle_model: the drafter expects target features of width "
                         f"{width}, got shape {tuple(features.shape)} (trained for "
                         f"another target?)")
    return features.float().cpu()


def owed_features(pending: torch.Tensor, guess: list[torch.Tensor] | None, committed: int,
                  held: int) -> torch.Tensor:
    """The input features of the pairs a drafter holding ``held`` pairs owes for
    ``committed`` tokens: the target's queued ``pending`` ``[c, F]`` or, with none queued
    (drafting ahead), its own outputs ``guess`` on a guessed path of exactly that length;
    empty when it has neither (a 1-token prompt). RuntimeError when the count of queued
    features does not match."""
    if not len(pending) and guess is not None and committed - 1 - held == len(guess):
        pending = torch.stack(guess).float().cpu()
    c = pending.shape[0]
    if c and held + c != committed - 1:
        raise RuntimeError(f"eagle: {c} pending features for {committed - 1 - held} "
                           f"committed positions after the {held} the drafter holds")
    return pending


class EagleConfig(TreeKnobs):
    """``eagle``: an EAGLE feature drafter (``eagle_model``) drafting EAGLE-2 trees
    (``builder: eagle2``, ``tree_top_k`` per level) or optimal / SALF trees."""

    name: Literal["eagle"] = "eagle"
    needs_features = True  # the drafter reads the target's last-layer features
    needs_draft_model = False  # the drafter is its own folder, not models.draft
    eagle_model: Any = Field(None, validate_default=True,
                             description="EAGLE drafter: a speclab folder (EAGLE-1/2 or "
                             "EAGLE-3), an EAGLE-1/2 / HASS / EAGLE-3 (EAGLE, SpecForge) / "
                             "speculators checkpoint, or a models:/ URI")
    builder: Builder = Field("eagle2", description="eagle tree builder: eagle2, optimal, salf")
    tree_top_k: int = Field(4, gt=0, description="EAGLE-2 children per node / beam width")
    batch: int = Field(4, gt=0, description="nodes expanded per draft forward (optimal/SALF)")
    salf_threshold: float = Field(0.3, gt=0.0, lt=1.0,
                                  description="SALF stopping threshold th, in (0, 1)")

    def traits(self):
        """:meth:`MethodSpec.traits` plus the target features the drafter reads: the last
        layer's (EAGLE-1/2) or an EAGLE-3 drafter's ``feature_layers``."""
        from dataclasses import replace

        return replace(super().traits(), feature_layers=eagle_feature_spec(self.eagle_model))

    @field_validator("eagle_model")
    @classmethod
    def _given(cls, v: Any) -> Any:
        if v is None or v == "":
            raise ValueError("method 'eagle' needs a drafter (--eagle-model DIR or "
                             "models:/ URI)")
        if not isinstance(v, str) and not is_eagle_model(v):
            raise ValueError(f"must be a folder or models:/ URI, got {type(v).__name__}")
        return v

    def _model(self, ctx) -> torch.nn.Module:
        """The drafter: ``eagle_model`` itself when loaded, else loaded once per context
        (speclab's folder or a public checkpoint, EAGLE-1/2, HASS, speculators, which
        takes the target's LM head) where the target's features are; checked against
        the target."""
        model = self.eagle_model
        if not is_eagle_model(model):
            model = ctx.cached(("eagle", model), lambda: load_eagle(
                registry_or_folder(self.eagle_model, "eagle_model"), ctx.target_config,
                dtype=ctx.dtype, device=ctx.device, target=ctx.target_model))
        if ctx.target_config is not None:
            model.meta.check_target(ctx.target_config)
        return model

    def build(self, ctx) -> EagleDrafter:
        return EagleDrafter(self._model(ctx), self.tree_top_k, self.depth, self.nodes,
                            self.score_temperature, self.builder, self.batch,
                            self.salf_threshold)

    def build_batch(self, ctx):
        """:class:`~speclab.families.eagle.drafter_batch.BatchEagleDrafter`: the same trees,
        every row's drafter step in one forward."""
        from speclab.drafters.eagle2 import eagle2_steps
        from speclab.drafters.optimal import optimal_steps
        from speclab.families.eagle.drafter_batch import (
            BatchEagleDrafter,
            FeatureBatchRunner,
            StaticFeatureBatchRunner,
        )

        if self.builder == "eagle2":
            steps, k = eagle2_steps(self.tree_top_k, self.depth, self.nodes), self.tree_top_k
        else:
            threshold = self.salf_threshold if self.builder == "salf" else 0.0
            steps = optimal_steps(self.nodes, min(self.batch, self.nodes), threshold,
                                  self.depth)
            k = self.nodes
        model = self._model(ctx)
        runner = ctx.batch_runner(model, FeatureBatchRunner, StaticFeatureBatchRunner)
        return BatchEagleDrafter(model, steps, k, self.score_temperature, runner)



def eagle_feature_spec(eagle_model) -> object:
    """The target features an EAGLE drafter (a loaded model, a folder or a ``models:/``
    URI) reads (:mod:`speclab.decoding.features`): None for EAGLE-1/2, an EAGLE-3
    drafter's ``feature_layers`` (``"eagle3"``, the paper's default, for a public EAGLE-3
    checkpoint that does not name them). Read from the folder's ``config.json``."""
    if is_eagle_model(eagle_model):
        return eagle_model.meta.feature_layers
    if eagle_model.startswith(("models:/", "runs:/")):
        return _registered_feature_spec(eagle_model)
    from speclab.models.formats import drafter_feature_spec

    return drafter_feature_spec(eagle_model)


@functools.lru_cache(maxsize=64)
def _registered_feature_spec(uri: str) -> object:
    """:func:`eagle_feature_spec` of a registry URI, downloaded once per process (a URI
    names one drafter for the process's lifetime, as the drafters it loads are cached by
    that string too): traits are read on every generate call."""
    from speclab.models.formats import drafter_feature_spec

    return drafter_feature_spec(registry_or_folder(uri, "eagle_model"))

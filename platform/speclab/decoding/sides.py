"""The two sides of a speculative decoding round, as the ONE loop (:mod:`.loop`) sees them.

* :class:`DraftSide` — ``start(prompt_ids, prefill_top)`` then, each round,
  ``propose(accepted_path, new_tokens, budget) -> Proposal``: it first tells its drafter
  which path of the last tree the target accepted and which tokens were committed, then
  drafts the next tree rooted at the last committed token.
* :class:`TargetSide` — ``start(prompt_ids, prefill_top_k) -> prefill top tokens`` then,
  each round, ``verify(tree) -> VerifyResult``: ONE target forward over every node of the
  tree (``None``: the root alone, i.e. plain decoding), the request's verification rule,
  and the target cache pruned to the accepted path.

Feature drafters (EAGLE, Medusa; ``DraftTraits.needs_features``) also read the target's last-layer
features: a target side built with ``features=True`` keeps the prefill's
(``prefill_features``) and returns those of the accepted path with every verdict
(``VerifyResult.features``); the draft side hands both to its drafter's ``observe``.

Offline decoding calls these objects directly (the batched engine and the Serve
replicas hold many requests as rows instead: :mod:`speclab.decoding.batch_loop`,
:mod:`speclab.decoding.row_pool`); every driver runs the same loop. Plain decoding
(``ar``) is the empty draft side: no drafter, root-only rounds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from speclab.decoding.drafter import Drafter
from speclab.decoding.features import FeatureSpec
from speclab.decoding.host import fetch_lists
from speclab.decoding.rules import RuleSpec, Verdict, apply_rule
from speclab.decoding.runner import ModelRunner
from speclab.decoding.sampling import SamplingParams
from speclab.decoding.tree import TokenTree
from speclab.decoding.wire import pack_tensor, unpack_tensor


@dataclass
class Proposal:
    """A draft tree (a :class:`TokenTree`, or its wire dict between deployments), the
    draft model forwards the request has used so far and, in a pool that drafts ahead
    (:mod:`speclab.decoding.lookahead`), whether this round was drafted ahead: True (a
    hit, the tree was ready), False (a miss, drafted again), None (not drafted ahead)."""

    tree: TokenTree | dict
    draft_calls: int = 0
    ahead: bool | None = None


@dataclass
class VerifyResult:
    """The target's verdict on one tree: the accepted node ``path`` (root first), the
    committed tokens ``new`` (accepted drafts + the bonus), the round's counters and,
    for feature drafters, the target's features ``[len(path), H]`` at the path's nodes
    (the feature at node ``path[i]`` predicted ``new[i]``) and, for a request that asked
    for them, the target's log-probs of ``new`` (one
    :func:`~speclab.decoding.logprobs.token_logprobs` entry per token)."""

    path: list[int]
    new: list[int]
    accepted: int
    evaluated: int
    drafted: int
    features: Any = None
    logprobs: list | None = None

    def to_dict(self) -> dict:
        """Wire form (``features`` packed by :func:`pack_tensor`; the lists copied, their
        entries not: ``asdict`` deep-copied every list entry and the features tensor,
        once per row and round, 13% of a 16-client plain-decoding load on the reference
        pair in a profile)."""
        return {"path": list(self.path), "new": list(self.new), "accepted": self.accepted,
                "evaluated": self.evaluated, "drafted": self.drafted,
                "features": pack_tensor(self.features),
                "logprobs": None if self.logprobs is None else list(self.logprobs)}

    @classmethod
    def from_dict(cls, data: dict) -> VerifyResult:
        return cls(**{**data, "features": unpack_tensor(data.get("features"))})


def check_prompt(prompt_ids: list[int], vocab: int) -> None:
    """Prompt token ids must be a non-empty list of ints in ``[0, vocab)``."""
    if len(prompt_ids) == 0:
        raise ValueError("prompt: must contain at least one token")
    bad = [t for t in prompt_ids if isinstance(t, bool) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt_ids: token ids {bad[:5]} outside the vocabulary [0, {vocab})")


def prefill(target: ModelRunner, prompt_ids: list[int], logits: bool = True
            ) -> torch.Tensor | None:
    """Reset and cache ``prompt[:-1]``; returns its ``[L-1, V]`` logits (None for
    1-token prompts, or when ``logits`` is False: then no ``[L-1, V]`` tensor is
    computed at all). The last prompt token is the first round's root."""
    target.reset()
    if len(prompt_ids) > 1:
        out = target.forward(torch.tensor(prompt_ids[:-1], dtype=torch.long),
                             last_only=not logits)
        return out if logits else None
    return None


def verify_round(target: ModelRunner, tree: TokenTree, rule: RuleSpec, params: SamplingParams,
                 generator: torch.Generator | None) -> tuple[Verdict, list[int]]:
    """ONE forward over every node of ``tree`` (tree attention unless it is a chain), the
    rule, and the target cache pruned to the accepted path. Returns the verdict and the
    new committed tokens (accepted drafts + the bonus token)."""
    prefix = target.length
    if tree.is_chain():
        logits = target.forward(tree.token_tensor())
    else:
        logits = target.forward(
            tree.token_tensor(), tree.position_ids(prefix), tree.attention_mask(prefix)
        )
    verdict = apply_rule(rule, tree, logits, params, generator)
    target.keep(list(range(prefix)) + [prefix + i for i in verdict.path])
    return verdict, committed_tokens(tree, verdict)


def committed_tokens(tree: TokenTree, verdict: Verdict) -> list[int]:
    """The tokens a verdict commits: the accepted drafts, then the bonus token."""
    return [tree.tokens[i] for i in verdict.path[1:]] + [verdict.bonus]


class TargetSide:
    """One request on the target: its KV cache, sampling settings, rule and rng."""

    def __init__(self, runner: ModelRunner, sampling: SamplingParams, rule: RuleSpec,
                 generator: torch.Generator | None, features: bool = False,
                 feature_spec: FeatureSpec = None) -> None:
        """``features``: return the target's features with the prefill and each verdict,
        those ``feature_spec`` names (:mod:`speclab.decoding.features`; None: the last
        layer's)."""
        self.runner, self.sampling, self.rule, self.generator = runner, sampling, rule, generator
        self.root = -1
        self.features, self.spec = features, feature_spec
        self.prefill_features: torch.Tensor | None = None  # [P-1, F] when features
        if features:
            runner.track_hidden(feature_spec)

    def start(self, prompt_ids: list[int], prefill_top_k: int = 0) -> list[list[int]] | None:
        """Prefill ``prompt_ids[:-1]``. Returns the target's ``prefill_top_k`` best tokens
        per prompt position (row i follows ``prompt[:i+1]``) when a drafter asks for them
        (AASD's alignment sampling), else None."""
        check_prompt(prompt_ids, self.runner.vocab_size)
        logits = prefill(self.runner, prompt_ids, logits=bool(prefill_top_k))
        self.root = int(prompt_ids[-1])
        if self.features:
            self.prefill_features = (self.runner.features(self.spec).clone()
                                     if len(prompt_ids) > 1 else None)
        if prefill_top_k and logits is not None:
            k = min(prefill_top_k, logits.shape[-1])
            return fetch_lists(logits.topk(k, dim=-1).indices)[0]
        return None

    def verify(self, tree: TokenTree | dict | None) -> VerifyResult:
        """One round over ``tree`` (a TokenTree, its wire dict, or None for the root alone)."""
        if tree is None:
            tree = TokenTree(self.root)
        elif isinstance(tree, dict):
            tree = TokenTree.from_wire(tree)
        if tree.tokens[0] != self.root:
            raise ValueError(f"tree: root token {tree.tokens[0]} is not the last committed "
                             f"token {self.root}")
        verdict, new = verify_round(self.runner, tree, self.rule, self.sampling, self.generator)
        self.root = new[-1]
        feats = self.runner.features(self.spec)[verdict.path].clone() if self.features else None
        return VerifyResult(verdict.path, new, verdict.accepted, verdict.evaluated,
                            tree.num_drafted, feats)


    def cached_tokens(self) -> int:
        """KV positions this request holds (for Serve's state bounds)."""
        return self.runner.length

    def release(self) -> None:
        """Free the KV cache now."""
        self.runner.release()


class DraftSide:
    """One request on the draft: a drafter, the committed tokens and its last tree."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self.committed: list[int] = []
        self.last_tree: TokenTree | None = None
        self.calls0 = drafter.calls

    def start(self, prompt_ids: list[int], prefill_top: list[list[int]] | None = None,
              features: torch.Tensor | None = None) -> None:
        """A new sequence (``prefill_top``: what :meth:`TargetSide.start` returned;
        ``features``: its ``prefill_features``)."""
        self.drafter.start(list(prompt_ids), prefill_top)
        if features is not None:
            self.drafter.observe(features)
        self.committed = list(prompt_ids)
        self.last_tree = None
        self.calls0 = self.drafter.calls

    def propose(self, accepted_path: list[int] | None, new_tokens: list[int],
                budget: int, features: torch.Tensor | None = None) -> Proposal:
        """Commit the last round (``features``: the target's on its accepted path), then
        draft a tree of at most ``budget`` levels."""
        if self.last_tree is not None and accepted_path is not None:
            self.drafter.accept(self.last_tree, accepted_path)
        if features is not None:
            self.drafter.observe(features)
        self.committed += new_tokens
        self.last_tree = self.drafter.propose(self.committed, budget)
        return Proposal(self.last_tree, self.drafter.calls - self.calls0)

    def rewind(self, keep: int) -> None:
        """Keep only the first ``keep`` committed tokens and forget the last tree (a
        guessed round is undone; :meth:`Drafter.rewind`)."""
        self.committed = self.committed[:keep]
        self.last_tree = None
        self.drafter.rewind(keep)

    def cached_tokens(self) -> int:
        """KV positions this request holds (for Serve's state bounds)."""
        runner = getattr(self.drafter, "runner", None)
        return runner.length if runner is not None else len(self.committed)

    def release(self) -> None:
        """Free the drafter's cache (and hooks) now."""
        runner = getattr(self.drafter, "runner", None)
        if runner is not None:
            runner.release()

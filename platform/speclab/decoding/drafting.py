"""The drafting interfaces the engine drives; the method modules implement them.

* :class:`DraftTraits`: what a method needs from the round (a draft model, the target's
  features, the target's prefill top tokens, a verification rule of its own) and whether
  it drafts many rows in shared forwards. Declared by the method's config class
  (``MethodSpec.traits()``), so nobody builds a drafter to learn them.
* :class:`Drafter`: one sequence's drafter (``start``/``propose``/``accept``/``observe``;
  defined in :mod:`speclab.decoding.drafter`, below the draft side, re-exported here).
* :class:`BatchDrafter`: drafting for many rows (the batched engine's and Serve's draft
  side); :class:`PerRowDrafters` turns any :class:`Drafter` into one.
* :data:`TreeSteps` / :func:`run_steps`: a tree builder as a generator of expansion
  requests, so one builder grows a single tree or many rows' trees in lockstep.

The engine (this package) imports no method module: the layer above depends on it,
never the other way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import torch

from speclab.decoding.drafter import Drafter
from speclab.decoding.host import fetch_lists
from speclab.decoding.rules import RuleSpec
from speclab.decoding.sides import DraftSide
from speclab.decoding.tree import TokenTree


@dataclass(frozen=True)
class DraftTraits:
    """What a method's drafts need from the round.

    ``drafting``: False for plain decoding (the empty drafter); ``needs_features``: the
    drafter reads the target's features (EAGLE, Medusa), those ``feature_layers`` names
    (:mod:`speclab.decoding.features`; None: the last layer's, EAGLE-3: three layers');
    ``prefill_top_k``: top tokens per
    prompt position it reads from the target's prefill (AASD); ``rule``: the verification
    rule its trees need (None: the request's); ``batched``: it drafts many rows in shared
    draft forwards (else one drafter per row)."""

    drafting: bool = True
    needs_features: bool = False
    feature_layers: Any = None
    prefill_top_k: int = 0
    rule: RuleSpec | None = None
    batched: bool = False


def accepted_positions(base: int, slot: dict[int, int], path: list[int]) -> list[int]:
    """Cache positions a draft keeps after a round: the ``base`` committed ones, then those
    of the accepted ``path``'s nodes (root first) it processed (``slot``: node -> position),
    up to the first it did not."""
    keep = list(range(base))
    for node in path[1:]:
        if node not in slot:
            break
        keep.append(slot[node])
    return keep


class BatchDrafter(ABC):
    """Drafts a tree per row; rows are numbered in join order, gaps closed on :meth:`drop`."""

    @abstractmethod
    def join(self, prompts: list[list[int]], generators: list[torch.Generator | None],
             prefill_tops: list[list[list[int]] | None], features: list[torch.Tensor | None]
             ) -> None:
        """New rows at the end of the batch (per row: its prompt, rng, the target's prefill
        top tokens when the method reads them and its prefill features ``[P-1, H]`` when
        it reads features)."""

    @abstractmethod
    def propose(self, paths: list[list[int] | None], news: list[list[int]],
                budgets: list[int], features: list[torch.Tensor | None], deeper: int = 0
                ) -> list[TokenTree | None]:
        """Per row: commit last round's accepted ``paths[b]`` / tokens ``news[b]`` (and the
        target's features on that path), then draft a tree of at most ``budgets[b]``
        levels (None when the budget is 0: the row is left out of this call and keeps
        its state). ``deeper``: levels a drafter may add to its method's own length
        (drafting ahead, whose first level guesses the bonus token; drafters that
        cannot, ignore it)."""

    @abstractmethod
    def drop(self, rows: list[int]) -> None:
        """Rows ``rows`` leave the batch."""

    @property
    def rewindable(self) -> bool:
        """Whether :meth:`rewind` works (drafting ahead needs it)."""
        return False

    def rewind(self, row: int, keep: int) -> None:
        """Row ``row`` keeps only its first ``keep`` committed tokens and forgets its last
        tree (a round drafted on a guessed verdict that did not come, see
        :mod:`speclab.decoding.lookahead`); its next :meth:`propose` gets the real tokens
        and no path."""
        raise NotImplementedError(f"{type(self).__name__}: cannot rewind")

    @property
    @abstractmethod
    def calls(self) -> int:
        """Draft model forwards so far (a batched forward counts once)."""

    def release(self) -> None:
        """Free every row's draft state now (the run is over)."""
        self.drop(list(range(self.rows)))

    @abstractmethod
    def cached_tokens(self, row: int) -> int:
        """Positions of draft state row ``row`` holds (Serve's memory bound)."""

    @property
    @abstractmethod
    def rows(self) -> int:
        """Rows in the batch."""


class PerRowDrafters(BatchDrafter):
    """One drafter per row, built by ``make(generator)``: any method, batched verification,
    unbatched drafting."""

    def __init__(self, make: Callable[[torch.Generator | None], Drafter]) -> None:
        self.make = make
        self.sides: list[DraftSide] = []
        self._done_calls = 0

    def join(self, prompts, generators, prefill_tops, features) -> None:
        for ids, g, top, feats in zip(prompts, generators, prefill_tops, features, strict=True):
            side = DraftSide(self.make(g))
            side.start(ids, top, feats)
            self.sides.append(side)

    def propose(self, paths, news, budgets, features, deeper=0):
        del deeper  # a Drafter's length is its own
        out: list[TokenTree | None] = []
        for side, path, new, budget, feats in zip(self.sides, paths, news, budgets, features,
                                                  strict=True):
            out.append(side.propose(path, new, budget, feats).tree if budget > 0 else None)
        return out

    @property
    def rewindable(self) -> bool:
        return bool(self.sides) and all(s.drafter.rewindable for s in self.sides)

    def rewind(self, row: int, keep: int) -> None:
        self.sides[row].rewind(keep)

    def drop(self, rows: list[int]) -> None:
        for b in sorted(rows, reverse=True):
            side = self.sides.pop(b)
            self._done_calls += side.drafter.calls
            side.release()

    @property
    def calls(self) -> int:
        return self._done_calls + sum(s.drafter.calls for s in self.sides)

    def cached_tokens(self, row: int) -> int:
        return self.sides[row].cached_tokens()

    @property
    def rows(self) -> int:
        return len(self.sides)


@dataclass
class TopChildren:
    """The best children of some draft distributions, on the host: ``values[i]`` /
    ``ids[i]``, best first, for distribution ``i``. What a tree builder reads of a
    draft forward, so a batched drafter reads every row's in ONE fetch."""

    values: list[list[float]]
    ids: list[list[int]]

    def row(self, i: int, k: int) -> list[tuple[float, int]]:
        """The ``k`` best ``(probability, token)`` of distribution ``i``."""
        return list(zip(self.values[i][:k], self.ids[i][:k], strict=True))


def top_children(probs: torch.Tensor | TopChildren, k: int) -> TopChildren:
    """``probs`` ``[n, V]`` (or ``[V]``; any device) as its ``k`` best children per row,
    read with ONE fetch; a :class:`TopChildren` is returned as it is."""
    if isinstance(probs, TopChildren):
        return probs
    probs = probs.reshape(-1, probs.shape[-1])
    values, ids = probs.topk(min(k, probs.shape[-1]), dim=-1)
    return TopChildren(*fetch_lists(values, ids))


def split_top_children(probs: list[torch.Tensor], k: int) -> list[TopChildren]:
    """:func:`top_children` for several ``[n_i, V]`` tensors (e.g. one per row of a
    batch), read with ONE fetch."""
    if not probs:
        return []
    top = top_children(torch.cat([p.reshape(-1, p.shape[-1]) for p in probs]), k)
    out, at = [], 0
    for p in probs:
        n = p.reshape(-1, p.shape[-1]).shape[0]
        out.append(TopChildren(top.values[at:at + n], top.ids[at:at + n]))
        at += n
    return out


#: A tree builder as a generator: yields ``(work_tree, node_ids)`` to expand, receives
#: their ``[len(node_ids), V]`` draft probabilities (or their :class:`TopChildren`),
#: returns ``(tree, work -> tree index)``.
TreeSteps = Generator[tuple[TokenTree, list[int]], "torch.Tensor | TopChildren",
                      tuple[TokenTree, dict[int, int]]]


def run_steps(steps: TreeSteps,
              expand: Callable[[TokenTree, list[int]], torch.Tensor | TopChildren]
              ) -> tuple[TokenTree, dict[int, int]]:
    """Drive one tree builder with an ``expand`` function (the single-row way)."""
    probs = None
    while True:
        try:
            request = steps.send(probs)
        except StopIteration as stop:
            return stop.value
        probs = expand(*request)

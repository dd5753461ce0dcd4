"""Drafting for a batch of rows: the batched engine's draft side.

A :class:`BatchDrafter` drafts one tree per row each round. Rows join (with their
prompt, the target's prefill tops and features, and their own rng) and leave between
rounds, in the order the engine keeps them.

* :class:`PerRowDrafters` works for EVERY method: one ordinary :class:`Drafter` per row,
  each drafting alone (its draft forwards are not batched; the target's are).
* :class:`BatchModelDrafter` is the base of drafters whose draft LM runs over all rows
  in ONE forward per step (:class:`~speclab.decoding.batch_runner.BatchRunner`): chain
  and, through :class:`BatchTreeDrafter`, the EAGLE-2 and optimal/SALF trees
  (``MethodSpec.build_batch``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Generator

import torch

from speclab.decoding.batch_runner import BatchRunner
from speclab.decoding.rules import RuleSpec
from speclab.decoding.runner import tree_node_inputs
from speclab.decoding.sides import DraftSide
from speclab.decoding.tree import TokenTree
from speclab.drafters.base import Drafter, accepted_positions


class BatchDrafter(ABC):
    """Drafts a tree per row; rows are numbered in join order, gaps closed on :meth:`drop`."""

    prefill_top_k = 0
    needs_features = False
    rule: RuleSpec | None = None
    batched = True  # draft forwards run over all rows at once

    @abstractmethod
    def join(self, prompts: list[list[int]], generators: list[torch.Generator | None],
             prefill_tops: list[list[list[int]] | None], features: list[torch.Tensor | None]
             ) -> None:
        """New rows at the end of the batch (per row: its prompt, rng, the target's prefill
        top tokens when ``prefill_top_k`` and its prefill features ``[P-1, H]`` when
        ``needs_features``)."""

    @abstractmethod
    def propose(self, paths: list[list[int] | None], news: list[list[int]],
                budgets: list[int], features: list[torch.Tensor | None]) -> list[TokenTree | None]:
        """Per row: commit last round's accepted ``paths[b]`` / tokens ``news[b]`` (and the
        target's features on that path), then draft a tree of at most ``budgets[b]``
        levels (None when the budget is 0: the root alone)."""

    @abstractmethod
    def drop(self, rows: list[int]) -> None:
        """Rows ``rows`` leave the batch."""

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
    """One drafter per row, built by ``make(generator)``: any registered method, batched
    verification, unbatched drafting."""

    batched = False

    def __init__(self, make: Callable[[torch.Generator | None], Drafter],
                 probe: Drafter | None = None) -> None:
        """``probe``: a drafter ``make`` already built (read for the method's traits)."""
        self.make = make
        self.sides: list[DraftSide] = []
        probe = probe if probe is not None else make(None)
        self.prefill_top_k = probe.prefill_top_k
        self.needs_features = probe.needs_features
        self.rule = probe.rule
        self._done_calls = 0

    def join(self, prompts, generators, prefill_tops, features) -> None:
        for ids, g, top, feats in zip(prompts, generators, prefill_tops, features, strict=True):
            side = DraftSide(self.make(g))
            side.start(ids, top, feats)
            self.sides.append(side)

    def propose(self, paths, news, budgets, features):
        out: list[TokenTree | None] = []
        for side, path, new, budget, feats in zip(self.sides, paths, news, budgets, features,
                                                  strict=True):
            out.append(side.propose(path, new, budget, feats).tree if budget > 0 else None)
        return out

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


class BatchModelDrafter(BatchDrafter):
    """Base for batched drafters over a draft LM (the batched :class:`ModelDrafter`).

    Per row the cache holds a prefix of the committed tokens; :meth:`sync` feeds each
    row what it lacks (always the root) in ONE forward; tree nodes are appended during
    the round (``slots[b]``: node -> logical cache position) and :meth:`accept` keeps the
    committed prefix plus the accepted, processed nodes.
    """

    def __init__(self, runner: BatchRunner) -> None:
        self.runner = runner
        self.committed: list[list[int]] = []
        self.generators: list[torch.Generator | None] = []
        self.last: list[TokenTree | None] = []
        self.base: list[int] = []
        self.slots: list[dict[int, int]] = []

    @property
    def calls(self) -> int:
        return self.runner.calls

    def cached_tokens(self, row: int) -> int:
        return self.runner.length(row)

    @property
    def rows(self) -> int:
        return len(self.committed)

    def join(self, prompts, generators, prefill_tops, features) -> None:
        del prefill_tops, features
        self.runner.add_rows([list(p[:-1]) for p in prompts])
        for p, g in zip(prompts, generators, strict=True):
            self.committed.append(list(p))
            self.generators.append(g)
            self.last.append(None)
            self.base.append(0)
            self.slots.append({})

    def drop(self, rows: list[int]) -> None:
        self.runner.drop(rows)
        for b in sorted(rows, reverse=True):
            for state in (self.committed, self.generators, self.last, self.base, self.slots):
                state.pop(b)

    def accept(self, paths: list[list[int] | None]) -> None:
        """Keep, per row, the committed prefix plus the accepted nodes already processed."""
        for b, (tree, path) in enumerate(zip(self.last, paths, strict=True)):
            if tree is not None and path is not None:
                self.runner.keep(b, accepted_positions(self.base[b], self.slots[b], path))

    def sync(self, rows: list[int]) -> torch.Tensor:
        """Feed rows ``rows`` the committed tokens their cache lacks (ONE forward for all);
        returns their ``[len(rows), V]`` root logits."""
        tokens = [torch.zeros(0, dtype=torch.long) for _ in range(self.runner.rows)]
        for b in rows:
            committed = self.committed[b]
            if self.runner.length(b) >= len(committed):  # root already processed: re-run it
                self.runner.crop(b, len(committed) - 1)
            tokens[b] = torch.tensor(committed[self.runner.length(b):], dtype=torch.long)
        logits = self.runner.forward(tokens)
        out = []
        for b in rows:
            n = int(tokens[b].shape[0])
            out.append(logits[b, n - 1])
            self.base[b] = self.runner.length(b)
            self.slots[b] = {0: self.base[b] - 1}
        return torch.stack(out) if out else logits[:0, 0]

    def expand(self, requests: dict[int, tuple[TokenTree, list[int]]]) -> dict[int, torch.Tensor]:
        """Run the draft on ``requests[b] = (tree, nodes)`` for several rows in ONE forward
        with per-row tree attention; returns ``{b: [len(nodes), V] logits}``."""
        tokens = [torch.zeros(0, dtype=torch.long) for _ in range(self.runner.rows)]
        positions: list[torch.Tensor | None] = [None] * self.runner.rows
        allowed: list[torch.Tensor | None] = [None] * self.runner.rows
        for b, (tree, nodes) in requests.items():
            tok, pos, mask = tree_node_inputs(self.runner.length(b), tree, nodes, self.base[b],
                                              self.slots[b])
            tokens[b], positions[b], allowed[b] = tok, pos, mask
        logits = self.runner.forward(tokens, positions, allowed)
        return {b: logits[b, :len(nodes)] for b, (_tree, nodes) in requests.items()}

    def propose(self, paths, news, budgets, features):
        del features
        self.accept(paths)
        for b, new in enumerate(news):
            self.committed[b] += new
        rows = [b for b, budget in enumerate(budgets) if budget > 0]
        trees: list[TokenTree | None] = [None] * len(budgets)
        if rows:
            drafted = self.draft(rows, self.sync(rows), [budgets[b] for b in rows])
            for b, tree in zip(rows, drafted, strict=True):
                trees[b] = tree
        self.runner.maybe_compact()
        for b, tree in enumerate(trees):  # rows left out of this call keep their last tree
            if tree is not None or paths[b] is not None or news[b] or budgets[b] > 0:
                self.last[b] = tree
        return trees

    @abstractmethod
    def draft(self, rows: list[int], root_logits: torch.Tensor, budgets: list[int]
              ) -> list[TokenTree]:
        """Trees for rows ``rows`` (``root_logits`` ``[len(rows), V]``, their budgets), with
        batched :meth:`expand` calls; ``slots`` must map each tree's processed nodes."""


#: A tree builder as a generator: yields ``(work_tree, node_ids)`` to expand, receives
#: their ``[len(node_ids), V]`` draft probabilities, returns ``(tree, work -> tree index)``.
TreeSteps = Generator[tuple[TokenTree, list[int]], torch.Tensor, tuple[TokenTree, dict[int, int]]]


def run_steps(steps: TreeSteps, expand: Callable[[TokenTree, list[int]], torch.Tensor]
              ) -> tuple[TokenTree, dict[int, int]]:
    """Drive one tree builder with an ``expand`` function (the single-row way)."""
    probs = None
    while True:
        try:
            request = steps.send(probs)
        except StopIteration as stop:
            return stop.value
        probs = expand(*request)


class BatchTreeDrafter(BatchModelDrafter):
    """Tree drafting for many rows: every row's builder (``steps(root_token, root_probs,
    budget)``) advances in lockstep, and each step's expansions of ALL rows run in ONE
    draft forward. Rows whose tree is done (e.g. SALF stopping early) leave the lockstep.
    Nodes are ranked by ``softmax(logits / score_temperature)``."""

    def __init__(self, runner: BatchRunner, name: str,
                 steps: Callable[[int, torch.Tensor, int], TreeSteps],
                 score_temperature: float = 1.0) -> None:
        if score_temperature <= 0:
            raise ValueError(f"score_temperature: must be > 0, got {score_temperature}")
        super().__init__(runner)
        self.name, self.steps, self.score_temperature = name, steps, score_temperature

    def draft(self, rows, root_logits, budgets):
        st = self.score_temperature
        root_probs = (root_logits / st).softmax(-1)
        running = {b: self.steps(self.committed[b][-1], root_probs[j], budgets[j])
                   for j, b in enumerate(rows)}
        results: dict[int, tuple[TokenTree, dict[int, int]]] = {}
        replies: dict[int, torch.Tensor | None] = dict.fromkeys(rows)
        while running:
            requests = {}
            for b in list(running):
                try:
                    requests[b] = running[b].send(replies[b])
                except StopIteration as stop:
                    results[b] = stop.value
                    del running[b]
            if requests:
                out = self.expand(requests)
                replies = {b: (logits / st).softmax(-1) for b, logits in out.items()}
        trees = []
        for b in rows:
            tree, old_to_new = results[b]
            self.slots[b] = {old_to_new[o]: s for o, s in self.slots[b].items()
                             if o in old_to_new}
            trees.append(tree)
        return trees

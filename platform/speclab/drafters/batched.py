"""Batched drafting over a draft LM: the shared machinery of methods that draft many
rows in shared forwards (the interface, :class:`~speclab.decoding.drafting.BatchDrafter`,
and the per-row fallback, :class:`~speclab.decoding.drafting.PerRowDrafters`, belong to
the engine).

* :class:`BatchModelDrafter` is the base of drafters whose draft LM runs over all rows
  in ONE forward per step (:class:`~speclab.decoding.batch_runner.BatchRunner`): chain
  and, through :class:`BatchTreeDrafter`, the EAGLE-2 and optimal/SALF trees
  (``MethodSpec.build_batch``).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable

import torch

from speclab.decoding.batch_runner import BatchRunner, last_indices
from speclab.decoding.drafting import (
    BatchDrafter,
    TopChildren,
    TreeSteps,
    accepted_positions,
    split_top_children,
)
from speclab.decoding.host import longs
from speclab.decoding.runner import tree_node_inputs
from speclab.decoding.tree import TokenTree


class BatchModelDrafter(BatchDrafter):
    """Base for batched drafters over a draft LM (the batched :class:`ModelDrafter`).

    Per row the cache holds a prefix of the committed tokens; :meth:`sync` feeds each
    row what it lacks (always the root) in ONE forward; tree nodes are appended during
    the round (``slots[b]``: node -> logical cache position) and :meth:`accept` keeps the
    committed prefix plus the accepted, processed nodes.

    A joining row's prompt is prefilled when the row first drafts, not when it joins
    (:meth:`prefill`): rows decoded plainly (an ``auto`` budget of 0, the rule at a
    batch size where drafting does not pay) never cost a draft prefill. The runner holds
    the first :attr:`held` rows; those that joined since wait at the end of the batch
    (rows join at the end and leave from anywhere, so the waiting ones stay a suffix)
    and are prefilled together, grouped by length
    (:meth:`~speclab.decoding.batch_runner.BatchRunner.add_rows`), up to the last one
    that drafts. SmolLM2 at 16 rows of ShareGPT prompts (35 to 1,465 tokens): the 4-layer draft
    model's prefill took 0.27 s, 4% of a 48-token run that an ``auto`` budget decoded
    plainly.
    """

    def __init__(self, runner: BatchRunner) -> None:
        self.runner = runner
        self.committed: list[list[int]] = []
        self.generators: list[torch.Generator | None] = []
        self.last: list[TokenTree | None] = []
        self.base: list[int] = []
        self.slots: list[dict[int, int]] = []
        self.held = 0  # rows the runner holds (the first ones); the others wait to draft

    @property
    def calls(self) -> int:
        return self.runner.calls

    def cached_tokens(self, row: int) -> int:
        return self.runner.length(row) if row < self.held else 0

    @property
    def rows(self) -> int:
        return len(self.committed)

    def join(self, prompts, generators, prefill_tops, features) -> None:
        """New rows at the end; their prompts wait for the rows' first draft
        (:meth:`prefill`)."""
        del prefill_tops, features
        for p, g in zip(prompts, generators, strict=True):
            self.committed.append(list(p))
            self.generators.append(g)
            self.last.append(None)
            self.base.append(0)
            self.slots.append({})

    def prefill(self, rows: list[int]) -> None:
        """Feed waiting rows ``rows`` (the batch's last ones, in order) what they have
        committed, all but the last token (the first :meth:`sync` feeds it for the root's
        logits), as new rows of the runner."""
        self.runner.add_rows([list(self.committed[b][:-1]) for b in rows], logits=False)

    def hold_waiting(self, budgets: list[int]) -> None:
        """Prefill the waiting rows (:meth:`prefill`) up to the last one that drafts (a
        budget above 0); those after it wait on (an ``auto`` probe drafts one row)."""
        drafting = [b for b in range(self.held, self.rows) if budgets[b] > 0]
        if drafting:
            self.prefill(list(range(self.held, drafting[-1] + 1)))
            self.held = drafting[-1] + 1

    def drop(self, rows: list[int]) -> None:
        self.runner.drop([b for b in rows if b < self.held])
        self.held -= sum(1 for b in set(rows) if b < self.held)
        for b in sorted(rows, reverse=True):
            for state in (self.committed, self.generators, self.last, self.base, self.slots):
                state.pop(b)

    @property
    def rewindable(self) -> bool:
        return True

    def rewind(self, row: int, keep: int) -> None:
        """Row ``row``'s committed tokens and cache keep their first ``keep``; its last
        tree is forgotten (:meth:`sync` feeds the rest with its next proposal)."""
        self.committed[row] = self.committed[row][:keep]
        if row < self.held:
            self.runner.crop(row, min(self.runner.length(row), keep))
        self.last[row] = None
        self.base[row], self.slots[row] = 0, {}

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
            tokens[b] = longs(committed[self.runner.length(b):])
        logits = self.runner.forward(tokens, logits_at=last_indices(tokens))
        out = []
        for b in rows:
            out.append(logits[b, 0])
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

    def observe(self, row: int, features: torch.Tensor | None) -> None:
        """The target's features ``[n, F]`` (or None) of row ``row``'s newly committed
        positions: a feature drafter's input; a draft LM reads none."""

    def bare_tree(self, row: int) -> TokenTree | None:
        """A tree for a row that cannot draft this round (its root alone), or None: the
        row drafts. A draft LM always can."""
        return None

    def propose(self, paths, news, budgets, features, deeper=0):
        self.accept(paths)
        for b, (new, f) in enumerate(zip(news, features, strict=True)):
            self.committed[b] += new
            self.observe(b, f)
        self.hold_waiting(budgets)
        trees: list[TokenTree | None] = [None] * len(budgets)
        rows = []
        for b, budget in enumerate(budgets):
            if budget > 0:
                trees[b] = self.bare_tree(b)
                if trees[b] is None:
                    rows.append(b)
        if rows:
            drafted = self.draft(rows, self.sync(rows), [budgets[b] for b in rows], deeper)
            for b, tree in zip(rows, drafted, strict=True):
                trees[b] = tree
        self.runner.maybe_compact()
        for b, tree in enumerate(trees):  # rows left out of this call keep their last tree
            if tree is not None or paths[b] is not None or news[b] or budgets[b] > 0:
                self.last[b] = tree
        return trees

    @abstractmethod
    def draft(self, rows: list[int], root_logits: torch.Tensor, budgets: list[int],
              deeper: int = 0) -> list[TokenTree]:
        """Trees for rows ``rows`` (``root_logits`` ``[len(rows), V]``, their budgets; up
        to ``deeper`` levels beyond the method's length), with batched :meth:`expand`
        calls; ``slots`` must map each tree's processed nodes."""


class BatchTreeDrafter(BatchModelDrafter):
    """Tree drafting for many rows: every row's builder (``steps(root_token, root_probs,
    budget, deeper)``: at most ``budget`` levels, ``deeper`` beyond the method's depth)
    advances in lockstep, and each step's expansions of ALL rows run in ONE
    draft forward. Rows whose tree is done (e.g. SALF stopping early) leave the lockstep.
    Nodes are ranked by ``softmax(logits / score_temperature)``; a builder reads the
    ``k`` best children of each expanded node (:class:`~speclab.decoding.drafting.
    TopChildren`), every row's read in ONE fetch per draft forward."""

    def __init__(self, runner: BatchRunner, name: str,
                 steps: Callable[[int, TopChildren, int, int], TreeSteps], k: int,
                 score_temperature: float = 1.0) -> None:
        if score_temperature <= 0:
            raise ValueError(f"score_temperature: must be > 0, got {score_temperature}")
        super().__init__(runner)
        self.name, self.steps, self.score_temperature = name, steps, score_temperature
        self.k = k

    def draft(self, rows, root_logits, budgets, deeper=0):
        st = self.score_temperature
        roots = split_top_children(list((root_logits / st).softmax(-1)), self.k)
        running = {b: self.steps(self.committed[b][-1], roots[j], budgets[j], deeper)
                   for j, b in enumerate(rows)}
        results: dict[int, tuple[TokenTree, dict[int, int]]] = {}
        replies: dict[int, TopChildren | None] = dict.fromkeys(rows)
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
                tops = split_top_children([(logits / st).softmax(-1) for logits in out.values()],
                                          self.k)
                replies = dict(zip(out, tops, strict=True))
        trees = []
        for b in rows:
            tree, old_to_new = results[b]
            self.slots[b] = {old_to_new[o]: s for o, s in self.slots[b].items()
                             if o in old_to_new}
            trees.append(tree)
        return trees

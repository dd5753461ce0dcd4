"""Chain drafter with a fixed draft length gamma (Leviathan et al. Algorithm 1)."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from speclab.config.method import MethodSpec
from speclab.decoding.batch_runner import BatchRunner
from speclab.decoding.drafting import top_children
from speclab.decoding.host import fetch, fetch_lists
from speclab.decoding.runner import ModelRunner
from speclab.decoding.sampling import SamplingParams, sample, warp_probs
from speclab.decoding.tree import DETERMINISTIC, SAMPLED, TokenTree
from speclab.drafters.base import ModelDrafter
from speclab.drafters.batched import BatchModelDrafter


def draft_next(tree: TokenTree, node: int, logits: torch.Tensor, params: SamplingParams,
               generator: torch.Generator | None) -> int:
    """Append one draft token as ``node``'s child and return the new node.

    ``logits`` ``[V]``: the draft's next-token logits at ``node``. Greedy: the argmax
    (a deterministic child); sampling: a draw from ``q`` warped like the target's ``p``,
    recorded with ``q`` so speculative sampling can verify it losslessly.
    """
    return draft_next_rows([tree], [node], logits[None], params, [generator])[0]


def draft_next_rows(trees: list[TokenTree], nodes: list[int], logits: torch.Tensor,
                    params: SamplingParams, generators: list[torch.Generator | None]
                    ) -> list[int]:
    """:func:`draft_next` for several rows at once (``logits`` ``[R, V]``, row ``j``'s
    token drawn with ``generators[j]``), reading the device ONCE for all of them."""
    q = warp_probs(logits, params)
    out = []
    if params.greedy:  # q is one-hot at the argmax
        for tree, node, x in zip(trees, nodes, fetch_lists(q.argmax(-1))[0], strict=True):
            tree.set_children_kind(node, DETERMINISTIC)
            out.append(tree.add(x, node, 1.0))
        return out
    q_host = fetch(q)[0]
    for j, (tree, node, g) in enumerate(zip(trees, nodes, generators, strict=True)):
        x = sample(q_host[j], g)
        tree.set_children_kind(node, SAMPLED, q[j])
        out.append(tree.add(x, node, float(q_host[j, x])))
    return out


class ChainDrafter(ModelDrafter):
    """Drafts ``gamma`` tokens one after another from the draft model.

    Greedy (temperature 0): argmax tokens (deterministic children). Sampling: tokens are
    drawn from ``q`` warped exactly like the target's ``p`` and recorded with ``q`` so
    that speculative sampling can verify them losslessly.
    """

    name = "chain"

    def __init__(
        self,
        runner: ModelRunner,
        gamma: int,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> None:
        if gamma < 1:
            raise ValueError(f"gamma: must be >= 1, got {gamma}")
        super().__init__(runner)
        self.gamma = gamma
        self.params = params
        self.generator = generator

    def propose(self, committed: list[int], budget: int) -> TokenTree:
        logits = self.sync(committed)
        tree = TokenTree(committed[-1])
        node = 0
        steps = min(self.gamma, budget)
        for i in range(steps):
            node = draft_next(tree, node, logits, self.params, self.generator)
            if i + 1 < steps:
                logits = self.expand(tree, [node])[-1]
        return tree


class BatchChainDrafter(BatchModelDrafter):
    """:class:`ChainDrafter` for many rows: each draft step is ONE forward over every row
    still drafting (rows with a smaller budget stop early).

    Drafting ahead (``deeper`` levels, :mod:`speclab.decoding.lookahead`; greedy) the
    first level guesses the bonus token the target will add: it holds the
    ``bonus_guesses`` likeliest tokens, each followed by its own greedy chain of
    ``gamma`` (all rows' chains advance in ONE forward per step), so the round after a
    fully accepted chain is ready whenever the target's bonus is among them."""

    name = "chain"

    def __init__(self, runner: BatchRunner, gamma: int, params: SamplingParams,
                 bonus_guesses: int = 3) -> None:
        if gamma < 1:
            raise ValueError(f"gamma: must be >= 1, got {gamma}")
        super().__init__(runner)
        self.gamma, self.params, self.bonus_guesses = gamma, params, bonus_guesses

    def draft(self, rows, root_logits, budgets, deeper=0):
        if deeper and self.params.greedy and self.bonus_guesses > 1:
            return self._fan_out(rows, root_logits, budgets, deeper)
        trees = [TokenTree(self.committed[b][-1]) for b in rows]
        node = [0] * len(rows)
        steps = [min(self.gamma + deeper, budget) for budget in budgets]
        logits = list(root_logits)
        for i in range(max(steps)):
            now = [j for j in range(len(rows)) if i < steps[j]]  # rows still drafting
            added = draft_next_rows([trees[j] for j in now], [node[j] for j in now],
                                    torch.stack([logits[j] for j in now]), self.params,
                                    [self.generators[rows[j]] for j in now])
            for j, n in zip(now, added, strict=True):
                node[j] = n
            more = {b: (trees[j], [node[j]]) for j, b in enumerate(rows) if i + 1 < steps[j]}
            if more:
                out = self.expand(more)
                logits = [out[b][-1] if b in out else None for b in rows]
        return trees


    def _fan_out(self, rows: list[int], root_logits: torch.Tensor, budgets: list[int],
                 deeper: int) -> list[TokenTree]:
        """Greedy trees of ``bonus_guesses`` first-level tokens, each with a chain below
        it (at most ``gamma + deeper`` levels per row, within its budget)."""
        trees = [TokenTree(self.committed[b][-1]) for b in rows]
        levels = [min(self.gamma + deeper, budget) for budget in budgets]
        top = top_children(root_logits.float().softmax(-1), self.bonus_guesses)
        leaves = []
        for j, tree in enumerate(trees):
            tree.set_children_kind(0, DETERMINISTIC)
            leaves.append([tree.add(t, 0, p) for p, t in top.row(j, self.bonus_guesses)])
        for level in range(1, max(levels, default=0)):
            more = {b: (trees[j], leaves[j]) for j, b in enumerate(rows) if level < levels[j]}
            if not more:
                break
            out = self.expand(more)
            best = fetch_lists(*(out[b].argmax(-1) for b in more))
            for (b, (tree, nodes)), ids in zip(more.items(), best, strict=True):
                j = rows.index(b)
                for node in nodes:
                    tree.set_children_kind(node, DETERMINISTIC)
                leaves[j] = [tree.add(t, node, 1.0) for node, t in zip(nodes, ids, strict=True)]
        return trees


class ChainConfig(MethodSpec):
    """``chain``: Leviathan et al. speculative decoding with a fixed draft length."""

    name: Literal["chain"] = "chain"
    gamma: int = Field(4, gt=0, description="chain draft length")

    def draft_length(self) -> int:
        return self.gamma

    def build(self, ctx) -> ChainDrafter:
        return ChainDrafter(ctx.draft, self.gamma, ctx.sampling, ctx.generator)

    def build_batch(self, ctx) -> BatchChainDrafter:
        return BatchChainDrafter(ctx.make_batch_runner(), self.gamma, ctx.sampling)

"""SpecDec++ adaptive-length chain drafter (Algorithm 2).

Drafts one token at a time like :class:`~speclab.drafters.chain.ChainDrafter`;
after the draft model has processed ``Y_i`` its acceptance head predicts
``P(Y_i accepted | Y_<i accepted)`` from the final hidden state ``e_i``. Drafting stops
once ``1 - prod_i P_i > threshold`` (the predicted chance that some drafted token is
rejected) or at ``max_len`` tokens. As in the paper, the token drafted from the
distribution computed together with the last prediction is kept, so a round never
costs more draft forwards than a fixed-gamma chain of the same length. The head only
changes the LENGTH of each chain; verification stays the usual lossless rule.
"""

from __future__ import annotations

import torch

from speclab.decoding.acceptance_head import AcceptanceHead, should_stop
from speclab.drafters.base import ModelDrafter
from speclab.drafters.chain import draft_next
from speclab.decoding.runner import ModelRunner
from speclab.decoding.sampling import SamplingParams
from speclab.decoding.tree import TokenTree


class SpecDecPPDrafter(ModelDrafter):
    """Chain drafter whose length is chosen per round by an :class:`AcceptanceHead`."""

    name = "specdecpp"

    def __init__(
        self,
        runner: ModelRunner,
        head: AcceptanceHead,
        threshold: float,
        params: SamplingParams,
        max_len: int = 20,
        generator: torch.Generator | None = None,
    ) -> None:
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"threshold: must be in (0, 1), got {threshold}")
        if max_len < 1:
            raise ValueError(f"max_len: must be >= 1, got {max_len}")
        hidden = int(runner.model.config.hidden_size)
        if head.hidden_size != hidden:
            raise ValueError(f"head: the head reads hidden size {head.hidden_size} but the "
                             f"drafter's hidden size is {hidden}")
        super().__init__(runner)
        runner.track_hidden()
        self.head = head.to(runner.device).eval()
        self.threshold, self.max_len = threshold, max_len
        self.params, self.generator = params, generator
        self.lengths: list[int] = []  # drafted tokens per round

    @torch.inference_mode()
    def propose(self, committed: list[int], budget: int) -> TokenTree:
        logits = self.sync(committed)
        tree = TokenTree(committed[-1])
        node = 0
        steps = min(self.max_len, budget)
        accept: list[float] = []  # predicted P(Y_i accepted | Y_<i accepted)
        for i in range(steps):
            node = draft_next(tree, node, logits, self.params, self.generator)
            if i + 1 == steps or should_stop(accept, self.threshold):
                break
            logits = self.expand(tree, [node])[-1]
            accept.append(float(torch.sigmoid(self.head(self.runner.hidden[-1]))))
        self.lengths.append(len(tree) - 1)
        return tree

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

from typing import Any, Literal

import torch
from pydantic import Field, field_validator

from speclab.config.method import MethodSpec
from speclab.decoding.acceptance_head import AcceptanceHead, load_head, should_stop
from speclab.decoding.host import fetch_lists
from speclab.decoding.runner import ModelRunner
from speclab.decoding.sampling import SamplingParams
from speclab.decoding.tree import TokenTree
from speclab.drafters.base import ModelDrafter
from speclab.drafters.chain import draft_next


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
        self.head = head.to(runner.device).eval()  # (it casts the features to its dtype)
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
            accept += fetch_lists(torch.sigmoid(self.head(self.runner.hidden[-1:])).float())[0]
        self.lengths.append(len(tree) - 1)
        return tree


def head_folder(source: str) -> str:
    """A head folder: ``models:/`` URIs are downloaded; local folders are used as given
    (a head may sit next to a drafter copy or alone)."""
    if not source.startswith("models:/"):
        return source
    from speclab.models.loading import resolve_source

    return resolve_source(source, "head")


class SpecDecPPConfig(MethodSpec):
    """``specdecpp``: a chain whose length an acceptance head chooses each round."""

    renamed = {"threshold": "stop_threshold"}
    name: Literal["specdecpp"] = "specdecpp"
    head: Any = Field(None, validate_default=True,
                      description="SpecDec++ acceptance head folder or models:/ URI")
    stop_threshold: float = Field(0.3, gt=0.0, lt=1.0,
                                  description="SpecDec++ stop threshold h, in (0, 1)")
    max_draft: int = Field(20, gt=0, description="SpecDec++ draft length cap")

    def draft_length(self) -> int:
        return self.max_draft

    @field_validator("head")
    @classmethod
    def _given(cls, v: Any) -> Any:
        if v is None or v == "":
            raise ValueError("method 'specdecpp' needs an acceptance head (--head DIR or "
                             "models:/ URI)")
        if not isinstance(v, str | AcceptanceHead):
            raise ValueError(f"must be a folder or models:/ URI, got {type(v).__name__}")
        return v

    def build(self, ctx) -> SpecDecPPDrafter:
        head = self.head
        if not isinstance(head, AcceptanceHead):
            hidden = int(ctx.draft.model.config.hidden_size)
            head = ctx.cached(("head", head, hidden),
                              lambda: load_head(head_folder(self.head), hidden))
        return SpecDecPPDrafter(ctx.draft, head, self.stop_threshold, ctx.sampling,
                                self.max_draft, ctx.generator)

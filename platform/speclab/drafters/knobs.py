"""Knob groups shared by several methods' configs (declared once, with their bounds)."""

from __future__ import annotations

from pydantic import Field

from speclab.config.method import MethodSpec


class TreeKnobs(MethodSpec):
    """Size of a draft tree and how its nodes are ranked (EAGLE-2, optimal tree, SALF)."""

    depth: int = Field(5, gt=0, description="maximum draft depth (trees)")
    nodes: int = Field(16, gt=0, description="draft nodes per tree")
    score_temperature: float = Field(
        1.0, gt=0.0, allow_inf_nan=False,
        description="temperature of the draft softmax that ranks tree nodes")

    def draft_length(self) -> int:
        return self.depth


class RetrievalKnobs(MethodSpec):
    """What a retrieval drafter looks up and proposes (PLD, AASD, REST)."""

    needs_draft_model = False

    ngram: int = Field(10, ge=1, description="draft tokens per retrieved n-gram")
    max_key: int = Field(3, ge=1, description="longest lookup key (tokens)")
    candidates: int = Field(1, ge=1, description="retrieved n-grams per round")

    def draft_length(self) -> int:
        return self.ngram

"""REST drafter: continuations retrieved from a :class:`~speclab.decoding.datastore.Datastore`.

Each round the longest suffix of the committed text (up to ``max_key`` tokens) that
occurs in the datastore gives up to ``candidates`` most frequent continuations of up
to ``ngram`` tokens, merged into a trie (REST, He et al. 2024). Verification is the
usual lossless rule (children are deterministic proposals).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from speclab.decoding.datastore import Datastore
from speclab.decoding.tree import TokenTree
from speclab.drafters.base import Drafter
from speclab.drafters.knobs import RetrievalKnobs
from speclab.drafters.pld import check_retrieval_params


class RestDrafter(Drafter):
    """Retrieval drafting from an offline datastore; no draft model."""

    name = "rest"

    def __init__(self, store: Datastore, ngram: int = 6, max_key: int = 8,
                 candidates: int = 8) -> None:
        check_retrieval_params(ngram, max_key, candidates)
        self.store, self.ngram, self.candidates = store, ngram, candidates
        self.max_key = min(max_key, store.max_len)

    def reset(self) -> None:
        """Stateless between sequences."""

    def propose(self, committed: list[int], budget: int) -> TokenTree:
        depth = min(self.ngram, budget)
        if depth < 1:
            return TokenTree(committed[-1])
        for k in range(min(self.max_key, len(committed)), 0, -1):
            conts = self.store.continuations(committed[-k:], depth, self.candidates)
            if conts:
                return TokenTree.from_sequences(committed[-1], conts)
        return TokenTree(committed[-1])

    def accept(self, tree: TokenTree, path: list[int]) -> None:
        """Nothing to keep: retrieval depends only on the committed text."""


class RestConfig(RetrievalKnobs):
    """``rest``: continuations retrieved from a datastore (jobs/build_datastore.py)."""

    name: Literal["rest"] = "rest"
    datastore: Any = Field(None, validate_default=True, description="REST datastore folder")

    @field_validator("datastore")
    @classmethod
    def _given(cls, v: Any) -> Any:
        if v is None or v == "":
            raise ValueError("method 'rest' needs a datastore folder (--datastore)")
        if not isinstance(v, str | Datastore):
            raise ValueError(f"must be a folder, got {type(v).__name__}")
        return v

    def build(self, ctx) -> RestDrafter:
        store = self.datastore
        if not isinstance(store, Datastore):
            store = ctx.cached(("datastore", store), lambda: Datastore.load(self.datastore))
        return RestDrafter(store, self.ngram, self.max_key, self.candidates)

"""Prompt lookup drafting (PLD) and AASD (alignment-augmented SD), no draft model.

:class:`DraftPool` indexes the prompt and the generated text by n-gram keys of length
1..``max_key`` (AASD Algorithm 1, lines 1-7 and 20-24). Each round the longest key that
ends the current text and occurred before picks up to ``candidates`` earlier
occurrences (most recent first); the ``ngram`` tokens that followed each are merged
into one TokenTree (a trie).

AASD adds, for tokens retrieved from the PROMPT:

* alignment sampling: where the retrieved token is not the argmax of the target's
  prefill distribution at that prompt position, the top ``align_k`` tokens of that
  distribution become extra siblings (AASD section 3.2);
* conditional verification: prompt-retrieved and alignment-sampled nodes are marked
  ``relaxed`` and the drafter's ``rule`` names conditional verification
  (:func:`~speclab.decoding.rules.verify_conditional`) with (``alpha``, ``beta``);
  tokens retrieved from generated text stay strict.

With neither, PLD under greedy verification is lossless.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from pydantic import Field

from speclab.decoding.rules import RuleSpec
from speclab.decoding.tree import DETERMINISTIC, TokenTree
from speclab.drafters.base import Drafter
from speclab.drafters.knobs import RetrievalKnobs


def check_retrieval_params(ngram: int, max_key: int, candidates: int) -> None:
    """Bounds shared by the retrieval drafters (PLD, AASD, REST); ValueError names the field."""
    if ngram < 1:
        raise ValueError(f"ngram: draft tokens per candidate must be >= 1, got {ngram}")
    if max_key < 1:
        raise ValueError(f"max_key: the n-gram key length must be >= 1, got {max_key}")
    if candidates < 1:
        raise ValueError(f"candidates: must be >= 1, got {candidates}")


class DraftPool:
    """n-gram index of a growing token list: key -> positions right after its occurrences."""

    def __init__(self, max_key: int) -> None:
        if max_key < 1:
            raise ValueError(f"max_key: the n-gram key length must be >= 1, got {max_key}")
        self.max_key = max_key
        self.tokens: list[int] = []
        self.index: dict[tuple[int, ...], list[int]] = {}

    def extend(self, tokens: list[int]) -> None:
        """Append committed tokens and index every key that ends at each of them."""
        for tok in tokens:
            self.tokens.append(int(tok))
            end = len(self.tokens)
            for k in range(1, min(self.max_key, end) + 1):
                self.index.setdefault(tuple(self.tokens[end - k:end]), []).append(end)

    def lookup(self, max_candidates: int) -> tuple[int, list[int]]:
        """Longest key first: ``(key length, start positions)`` of up to ``max_candidates``
        earlier continuations of the current suffix, most recent first (``(0, [])``
        when no key of length 1..max_key occurred before)."""
        n = len(self.tokens)
        for k in range(min(self.max_key, n), 0, -1):
            hits = self.index.get(tuple(self.tokens[n - k:]), [])
            starts = [p for p in reversed(hits) if p < n][:max_candidates]
            if starts:
                return k, starts
        return 0, []


def aasd_rule(relax: tuple[float, float] | None) -> RuleSpec | None:
    """AASD's trees need conditional verification with its ``(alpha, beta)``; None (the
    request's rule) without relaxation."""
    return (RuleSpec("conditional", {"alpha": relax[0], "beta": relax[1]})
            if relax is not None else None)


def aasd_prefill_top_k(align_k: int) -> int:
    """Top tokens per prompt position AASD reads from the target's prefill: ``align_k``
    plus one, since the retrieved token itself may be the top one (0: none)."""
    return align_k + 1 if align_k else 0


class PromptLookupDrafter(Drafter):
    """PLD (``align_k=0``, ``relax=None``) and AASD (``align_k=2``, ``relax=(a, b)``)."""

    name = "pld"

    def __init__(self, ngram: int = 10, max_key: int = 3, candidates: int = 1,
                 align_k: int = 0, relax: tuple[float, float] | None = None) -> None:
        check_retrieval_params(ngram, max_key, candidates)
        if align_k < 0:
            raise ValueError(f"align_k: must be >= 0, got {align_k}")
        if relax is not None and relax[0] < 0:
            raise ValueError(f"aasd_alpha: must be >= 0, got {relax[0]}")
        self.ngram, self.max_key, self.candidates = ngram, max_key, candidates
        self.align_k, self.relax = align_k, relax
        self.rule = aasd_rule(relax)
        self.prefill_top_k = aasd_prefill_top_k(align_k)
        self.pool = DraftPool(max_key)
        self.prompt_len = 0
        self.prefill_top: list[list[int]] = []  # per prompt position: the target's top tokens

    def reset(self) -> None:
        self.pool = DraftPool(self.max_key)
        self.prompt_len = 0
        self.prefill_top = []

    def start(self, prompt_ids: list[int], prefill_top: list[list[int]] | None = None) -> None:
        self.reset()
        self.prefill_top = prefill_top or []

    def propose(self, committed: list[int], budget: int) -> TokenTree:
        if not self.pool.tokens:
            self.prompt_len = len(committed)
        self.pool.extend(committed[len(self.pool.tokens):])
        tree = TokenTree(committed[-1])
        depth = min(self.ngram, budget)
        if depth < 1:
            return tree
        _, starts = self.pool.lookup(self.candidates)
        toks, n = self.pool.tokens, len(self.pool.tokens)
        for start in starts:
            node = 0
            for j in range(start, min(start + depth, n)):
                from_prompt = j < self.prompt_len
                child = tree.find_child(node, toks[j])
                if child < 0:
                    tree.set_children_kind(node, DETERMINISTIC)
                    child = tree.add(toks[j], node, relaxed=from_prompt and self.relax is not None)
                if from_prompt and 1 <= j <= len(self.prefill_top):
                    self._align(tree, node, toks[j], self.prefill_top[j - 1])
                node = child
        return tree

    def _align(self, tree: TokenTree, parent: int, token: int, top: list[int]) -> None:
        """Alignment sampling: the prefill's top tokens as siblings of a misaligned one."""
        if not top or top[0] == token:
            return
        for alt in [t for t in top if t != token][: self.align_k]:
            if tree.find_child(parent, alt) < 0:
                tree.add(alt, parent, relaxed=self.relax is not None)

    def accept(self, tree: TokenTree, path: list[int]) -> None:
        """Nothing to prune: the pool syncs from the committed text on the next round."""


class PldConfig(RetrievalKnobs):
    """``pld``: prompt lookup decoding (no draft model); lossless."""

    name: Literal["pld"] = "pld"

    def build(self, ctx) -> PromptLookupDrafter:
        return PromptLookupDrafter(self.ngram, self.max_key, self.candidates)


class AasdConfig(RetrievalKnobs):
    """``aasd``: PLD + alignment sampling + conditional verification (relaxed)."""

    name: Literal["aasd"] = "aasd"
    align_k: int = Field(2, ge=0, description="AASD: alignment-sampled tokens per position")
    conditional: bool = Field(True, description="AASD: conditional verification (eq. 4-6); "
                                                "false: strict")
    aasd_alpha: float = Field(0.1, ge=0.0, allow_inf_nan=False,
                              description="AASD: entropy factor alpha (eq. 5)")
    aasd_beta: float = Field(0.1, allow_inf_nan=False,
                             description="AASD: threshold base beta (eq. 5)")

    def relax(self) -> tuple[float, float] | None:
        """Conditional verification's ``(alpha, beta)``, or None when strict."""
        return (self.aasd_alpha, self.aasd_beta) if self.conditional else None

    def traits(self):
        return replace(super().traits(), rule=aasd_rule(self.relax()),
                       prefill_top_k=aasd_prefill_top_k(self.align_k))

    def build(self, ctx) -> PromptLookupDrafter:
        return PromptLookupDrafter(self.ngram, self.max_key, self.candidates, self.align_k,
                                   self.relax())

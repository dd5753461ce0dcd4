"""The one-sequence drafter interface (:class:`Drafter`), below both the draft side that
drives it (:class:`speclab.decoding.sides.DraftSide`) and the batch drafters built on
that side (:mod:`speclab.decoding.drafting`, which re-exports it)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from speclab.decoding.tree import TokenTree


class Drafter(ABC):
    """Proposes draft trees for one sequence; ``calls`` / ``seconds`` count its model
    forwards. Two duties (as in transformers' candidate generators): ``propose`` a tree
    for the committed context, and ``accept`` the verified path so its own state (a KV
    cache) keeps only what was committed."""

    name = "drafter"
    #: whether :meth:`rewind` can undo a round (drafting ahead needs it)
    rewindable = False

    @abstractmethod
    def reset(self) -> None:
        """Start a new sequence."""

    @abstractmethod
    def propose(self, committed: list[int], budget: int) -> TokenTree:
        """Draft a tree rooted at ``committed[-1]`` with at most ``budget`` levels."""

    @abstractmethod
    def accept(self, tree: TokenTree, path: list[int]) -> None:
        """The target accepted ``path`` (root first) of the last proposed tree."""

    def start(self, prompt_ids: list[int], prefill_top: list[list[int]] | None = None) -> None:
        """Start a sequence. ``prefill_top[i]``: the target's ``prefill_top_k`` best tokens
        after ``prompt[:i+1]``, best first, sent only to methods whose traits declare
        ``prefill_top_k > 0`` (AASD's alignment sampling). Default: :meth:`reset`."""
        del prefill_top
        self.reset()

    def rewind(self, keep: int) -> None:
        """Forget everything after the first ``keep`` committed tokens (a round drafted
        on a guessed verdict that did not come; the next :meth:`propose` gets the real
        tokens and no accepted path). Only for drafters that declare ``rewindable``."""
        raise NotImplementedError(f"{self.name}: cannot rewind")

    def observe(self, features: torch.Tensor) -> None:
        """The target's features ``[n, H]`` at the next ``n`` committed positions: after
        :meth:`start` those of ``prompt[:-1]``, then each round those of the accepted path
        (root first). Called only for methods whose traits declare ``needs_features``."""
        del features

    @property
    def calls(self) -> int:
        return 0

    @property
    def seconds(self) -> float:
        return 0.0

"""Drafter interface and the shared machinery of drafters backed by a draft LM.

A drafter has two duties (as in transformers' candidate generators): ``propose`` a
tree for the current committed context, and ``accept`` the verified path so its own
state (KV cache) keeps only what was committed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from speclab.decoding.rules import RuleSpec
from speclab.decoding.runner import ModelRunner, forward_tree_nodes
from speclab.decoding.tree import TokenTree


class Drafter(ABC):
    """Proposes draft trees; ``calls`` / ``seconds`` count its model forwards."""

    name = "drafter"
    prefill_top_k = 0  # top tokens per prefill position it reads (0: ignores the prefill)
    rule: RuleSpec | None = None  # the verification rule its trees need (None: the request's)
    needs_features = False  # reads the target's last-layer features (EAGLE): see observe()

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
        after ``prompt[:i+1]``, best first, sent only to drafters that declare
        ``prefill_top_k > 0`` (AASD's alignment sampling). Default: :meth:`reset`."""
        self.reset()

    def observe(self, features: torch.Tensor) -> None:
        """The target's features ``[n, H]`` at the next ``n`` committed positions: after
        :meth:`start` those of ``prompt[:-1]``, then each round those of the accepted path
        (root first). Called only for drafters with ``needs_features``; others ignore it."""
        del features

    @property
    def calls(self) -> int:
        return 0

    @property
    def seconds(self) -> float:
        return 0.0


class ModelDrafter(Drafter):
    """Base for drafters that run a draft causal LM with a KV cache.

    The cache holds a prefix of the committed tokens; :meth:`sync` feeds the ones it
    lacks (always including the root) and returns the root's next-token logits. During
    a round, expanded tree nodes are appended to the cache (``slot`` maps node -> cache
    position); :meth:`accept` gathers the prefix plus the accepted, processed nodes.
    """

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.slot: dict[int, int] = {}
        self.base = 0

    @property
    def calls(self) -> int:
        return self.runner.calls

    @property
    def seconds(self) -> float:
        return self.runner.seconds

    def reset(self) -> None:
        self.runner.reset()

    def sync(self, committed: list[int]) -> torch.Tensor:
        """Process committed tokens missing from the cache; returns ``[V]`` root logits."""
        if self.runner.length >= len(committed):  # root already processed: re-run it
            self.runner.crop(len(committed) - 1)
        pending = torch.tensor(committed[self.runner.length :], dtype=torch.long)
        logits = self.runner.forward(pending)[-1]
        self.base = self.runner.length
        self.slot = {0: self.base - 1}
        return logits

    def expand(self, tree: TokenTree, nodes: list[int]) -> torch.Tensor:
        """Run the draft on tree ``nodes`` in ONE forward with tree attention.

        Every node's parent must already be processed. Returns ``[len(nodes), V]``
        logits (each node's distribution over its children).
        """
        return forward_tree_nodes(self.runner, tree, nodes, self.base, self.slot)

    def score_probs(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """Draft probabilities used to RANK tree nodes: ``softmax(logits / temperature)``.

        Tree children are verified as deterministic proposals, so this choice never
        affects losslessness; ``temperature < 1`` sharpens an under-confident drafter
        so path probabilities track real acceptance (see README, Benchmark).
        """
        return (logits / temperature).softmax(-1)

    def accept(self, tree: TokenTree, path: list[int]) -> None:
        self.runner.keep(accepted_positions(self.base, self.slot, path))


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

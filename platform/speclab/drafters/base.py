"""The shared machinery of drafters backed by a draft LM (:class:`ModelDrafter`).

The drafter interface itself (:class:`~speclab.decoding.drafting.Drafter`: ``propose`` a
tree for the committed context, ``accept`` the verified path) belongs to the engine,
:mod:`speclab.decoding.drafting`; it is re-exported here for method modules.
"""

from __future__ import annotations

import torch

from speclab.decoding.drafting import Drafter, accepted_positions
from speclab.decoding.host import longs
from speclab.decoding.runner import ModelRunner, forward_tree_nodes
from speclab.decoding.tree import TokenTree

__all__ = ["Drafter", "ModelDrafter", "accepted_positions"]


class ModelDrafter(Drafter):
    """Base for drafters that run a draft causal LM with a KV cache.

    The cache holds a prefix of the committed tokens; :meth:`sync` feeds the ones it
    lacks (always including the root) and returns the root's next-token logits. During
    a round, expanded tree nodes are appended to the cache (``slot`` maps node -> cache
    position); :meth:`accept` gathers the prefix plus the accepted, processed nodes.
    """

    rewindable = True

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.slot: dict[int, int] = {}
        self.base = 0

    def rewind(self, keep: int) -> None:
        """The cache keeps at most the first ``keep`` committed tokens; :meth:`sync` feeds
        the rest with the next proposal."""
        self.runner.crop(min(self.runner.length, keep))
        self.slot, self.base = {}, 0

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
        pending = longs(committed[self.runner.length :])
        logits = self.runner.forward(pending, last_only=True)[-1]
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

"""The two halves of AtSpeed beam SD (``POST /recommend``) for the serve deployments.

``RecTargetSide`` (inside :class:`serve_apps.target.TargetDeployment`) holds the target
recommender, turns a history into its prompt and verifies drafted beam levels with
strict top-K verification (:func:`speclab.decoding.beam.verify_beam_levels`, Algorithm 1:
lossless, the same top-K as the target's beam search). ``RecDraftSide`` (inside
:class:`serve_apps.draft.DraftDeployment`) drafts ``gamma`` levels of beam search with
beam ``N`` (:func:`speclab.decoding.beam.draft_beam_levels`). Each keeps the prompt's KV
cache of a request as a :class:`BeamState` in the replica's session store; what
travels between them is plain beams: ``[[token ids], log-prob]``.
"""

from __future__ import annotations

from dataclasses import dataclass

from speclab.data.rec_dataset import RecMeta
from speclab.models.loading import load_model
from speclab.decoding.beam import BeamTree, draft_beam_levels, verify_beam_levels
from speclab.decoding.runner import ModelRunner


@dataclass
class BeamState:
    """A request's prompt cache (and beam nodes) on one side."""

    tree: BeamTree

    def cached_tokens(self) -> int:
        return self.tree.runner.length

    def release(self) -> None:
        self.tree.runner.release()


def _beams(wire: list[list]) -> list[tuple[tuple[int, ...], float]]:
    return [(tuple(int(t) for t in seq), float(score)) for seq, score in wire]


def _wire(beams) -> list[list]:
    return [[list(seq), score] for seq, score in beams]


class RecTargetSide:
    """The target recommender and its item trie."""

    def __init__(self, folder: str, dtype: str, device: str) -> None:
        self.meta = RecMeta.load(folder)
        self.trie = self.meta.trie()
        self.model = load_model(folder, dtype, device, field="serve.rec_target")

    def start(self, history: list[int], k: int) -> tuple[BeamState, list[int]]:
        """A request's state (the prompt prefilled) and its prompt tokens."""
        if not 1 <= k <= len(self.meta.items):
            raise ValueError(f"k: must be in [1, {len(self.meta.items)}], got {k}")
        prompt = self.meta.prompt(history)
        return BeamState(BeamTree(ModelRunner(self.model), prompt)), prompt

    def verify(self, state: BeamState, drafted: list[list[list]], committed: list[list],
               k: int) -> dict:
        """Strict top-``k`` verification of drafted levels; ``items`` when finished."""
        cur, accepted = verify_beam_levels(state.tree, _beams(committed),
                                           [_beams(level) for level in drafted], self.trie, k)
        out = {"committed": _wire(cur), "accepted": accepted,
               "done": len(cur[0][0]) >= self.trie.length}
        if out["done"]:
            out["items"] = [self.trie.item_of(seq) for seq, _ in cur]
            out["scores"] = [round(score, 6) for _, score in cur]
        return out


class RecDraftSide:
    """The drafter recommender (same id tokens as the target)."""

    def __init__(self, folder: str, dtype: str, device: str) -> None:
        self.meta = RecMeta.load(folder)
        self.trie = self.meta.trie()
        self.model = load_model(folder, dtype, device, field="serve.rec_draft")
        self.meta.check_model(int(self.model.config.vocab_size))

    def start(self, prompt: list[int]) -> BeamState:
        """A request's state: the history prompt prefilled on the drafter."""
        return BeamState(BeamTree(ModelRunner(self.model), prompt))

    def draft(self, state: BeamState, committed: list[list], n: int, g: int) -> list[list[list]]:
        """``g`` levels of constrained beam search with beam ``n`` from ``committed``."""
        levels = draft_beam_levels(state.tree, _beams(committed), self.trie, n, g)
        return [_wire(level) for level in levels]

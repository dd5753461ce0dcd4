"""The two halves of AtSpeed beam SD (``POST /recommend``) for the serve deployments.

``RecTargetSide`` (inside :class:`serve_apps.target.TargetDeployment`) holds the target
recommender, turns a history into its prompt and keeps a
:class:`~speclab.decoding.beam_loop.BeamTargetSide` per request (strict top-K
verification, Algorithm 1: the same top-K as the target's beam search; or relaxed
sampling verification, Algorithm 2). ``RecDraftSide`` (inside
:class:`serve_apps.draft.DraftDeployment`) keeps a
:class:`~speclab.decoding.beam_loop.BeamDraftSide` per request. The ingress runs the
engine's beam loop (:func:`speclab.decoding.beam_loop.beam_rounds`) between them; what
travels is plain beams ``[[token ids], score]`` and, for relaxed rounds, each level's
``q`` as ``[[token ids], probability]`` pairs.
"""

from __future__ import annotations

import torch

from speclab.data.rec_dataset import RecMeta
from speclab.decoding.beam_loop import BeamDraftSide, BeamTargetSide, check_beam_args
from speclab.decoding.runner import ModelRunner
from speclab.models.loading import load_model


def beams_from_wire(wire: list[list]) -> list[tuple[tuple[int, ...], float]]:
    """``[[token ids], score]`` pairs -> beams."""
    return [(tuple(int(t) for t in seq), float(score)) for seq, score in wire]


def beams_to_wire(beams) -> list[list]:
    """Beams -> ``[[token ids], score]`` pairs."""
    return [[list(seq), score] for seq, score in beams]


def _proposal_to_wire(proposal: dict) -> dict:
    out = {"levels": [beams_to_wire(level) for level in proposal["levels"]]}
    if "q" in proposal:
        out["q"] = [[[list(s), p] for s, p in pairs] for pairs in proposal["q"]]
    return out


class RecTargetSide:
    """The target recommender and its item trie."""

    def __init__(self, folder: str, dtype: str, device: str) -> None:
        self.meta = RecMeta.load(folder)
        self.trie = self.meta.trie()
        self.model = load_model(folder, dtype, device, field="serve.rec_target")

    def start(self, history: list[int], k: int, mode: str = "strict",
              seed: int = 0) -> tuple[BeamTargetSide, list[int]]:
        """A request's target side (the prompt prefilled) and its prompt tokens."""
        if not 1 <= k <= len(self.meta.items):
            raise ValueError(f"k: must be in [1, {len(self.meta.items)}], got {k}")
        check_beam_args(mode, k, k, 1)
        prompt = self.meta.prompt(history)
        side = BeamTargetSide(ModelRunner(self.model), self.trie, mode, k,
                              torch.Generator().manual_seed(seed))
        side.start(prompt)
        return side, prompt

    def verify(self, side: BeamTargetSide, proposal: dict, committed: list[list]) -> dict:
        """One round's verdict: the new committed beams (wire form), the accepted steps,
        and, once the beams are complete, the ranked ``items`` and their ``scores``."""
        cur, accepted = side.verify(beams_from_wire(committed), proposal)
        out = {"committed": beams_to_wire(cur), "accepted": accepted,
               "done": len(cur[0][0]) >= self.trie.length}
        if out["done"]:
            final = side.result(cur)
            out["items"] = [self.trie.item_of(seq) for seq, _ in final]
            out["scores"] = [round(score, 6) for _, score in final]
        return out


class RecDraftSide:
    """The drafter recommender (same id tokens as the target)."""

    def __init__(self, folder: str, dtype: str, device: str) -> None:
        self.meta = RecMeta.load(folder)
        self.trie = self.meta.trie()
        self.model = load_model(folder, dtype, device, field="serve.rec_draft")
        self.meta.check_model(int(self.model.config.vocab_size))

    def start(self, prompt: list[int], mode: str = "strict", n: int = 10,
              seed: int = 0) -> BeamDraftSide:
        """A request's draft side: the history prompt prefilled on the drafter."""
        side = BeamDraftSide(ModelRunner(self.model), self.trie, mode, n,
                             torch.Generator().manual_seed(seed + 1))
        side.start(prompt)
        return side

    def draft(self, side: BeamDraftSide, committed: list[list], g: int) -> dict:
        """``g`` levels from ``committed`` (wire form)."""
        return _proposal_to_wire(side.propose(beams_from_wire(committed), g))

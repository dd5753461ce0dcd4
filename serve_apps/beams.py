"""AtSpeed beam SD (``POST /recommend``) on the Serve deployments, one hop per round.

``RecTargetSide`` (inside :class:`serve_apps.target.TargetDeployment`) holds the target
recommender, turns a history into its prompt and keeps a
:class:`~speclab.decoding.beam_loop.BeamTargetSide` per request (strict top-K
verification, Algorithm 1: the same top-K as the target's beam search; or relaxed
sampling verification, Algorithm 2). ``RecDraftSide`` (inside
:class:`serve_apps.draft.DraftDeployment`) holds the drafter recommender and DRIVES a
request, like the draft replica drives every other decoding request:
:meth:`RecDraftSide.recommend` runs the engine's beam loop
(:func:`speclab.decoding.beam_loop.beam_rounds`, the one offline search runs too) next
to the drafter, so a proposal is local and each round is ONE call to the target
(``rec_verify``); the ingress makes one call per request. What travels is plain beams
``[[token ids], score]`` and, for relaxed rounds, each level's ``q`` as
``[[token ids], probability]`` pairs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import torch

from speclab.data.rec_dataset import RecMeta
from speclab.decoding.beam_levels import BeamSDStats
from speclab.decoding.beam_loop import (
    BeamDraftSide,
    BeamPropose,
    BeamTargetSide,
    beam_rounds,
    check_beam_args,
)
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

    async def recommend(self, side: Callable[[], BeamDraftSide],
                        verify: Callable[[dict, list[list]], Awaitable[dict]], length: int,
                        gamma: int) -> tuple[dict, BeamSDStats]:
        """Run one request's beam SD rounds until its beams are ``length`` tokens long.

        ``side()``: the request's draft side (looked up every round, so a state freed by
        the replica's bounds fails the request); ``verify(proposal, committed)``: the
        target's verdict on one round (wire forms; ONE call). Returns the last verdict
        (``items`` and ``scores`` of the final beams, ranked by the target) and the
        search's stats."""
        stats = BeamSDStats()
        loop = beam_rounds(length, gamma, stats)
        reply: object = None
        verdict: dict = {}
        try:
            while True:
                try:
                    msg = loop.send(reply)
                except StopIteration:
                    break
                if isinstance(msg, BeamPropose):
                    reply = side().propose(msg.committed, msg.g)
                else:
                    verdict = await verify(_proposal_to_wire(msg.proposal),
                                           beams_to_wire(msg.committed))
                    reply = (beams_from_wire(verdict["committed"]), verdict["accepted"])
        finally:
            loop.close()
        return verdict, stats

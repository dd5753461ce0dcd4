"""AtSpeed beam SD as a draft side and a target side driven by ONE round loop, so that
offline search (:func:`run_beam_sd`) and the Serve app's ``POST /recommend`` run the
same rounds, with strict top-K (Algorithm 1) or relaxed sampling (Algorithm 2)
verification.

A round: the draft side proposes ``g`` levels of beams from the committed beams
(strict: its beam search with beam ``n``; relaxed: ``n`` sampled sequences per level and
each level's ``q``); the target side verifies them all in ONE forward and returns the
new committed beams and the number of accepted steps. Beams are ``(tokens, score)``
pairs (relaxed rounds carry score 0 until the final ranking).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Literal

import torch

from speclab.decoding.beam_levels import (
    Beam,
    BeamSDStats,
    BeamTree,
    check_beam_prompt,
    draft_beam_levels,
    draft_sampled_levels,
    ranked,
    verify_beam_levels,
    verify_sampled_levels,
)
from speclab.decoding.runner import ModelRunner
from speclab.decoding.trie import ItemTrie

Mode = Literal["strict", "relaxed"]
MODES = ("strict", "relaxed")


def check_beam_args(mode: str, k: int, n: int, gamma: int) -> None:
    """Bounds of a beam SD request; ValueError names the field."""
    if mode not in MODES:
        raise ValueError(f"verify: must be one of {MODES}, got {mode!r}")
    if n < k:
        raise ValueError(f"n: draft beam size must be >= k ({k}), got {n}")
    if gamma < 1:
        raise ValueError(f"gamma: must be >= 1, got {gamma}")


class BeamDraftSide:
    """The drafter recommender of one request: ``start(prompt)``, then ``propose``."""

    def __init__(self, runner: ModelRunner, trie: ItemTrie, mode: Mode, n: int,
                 generator: torch.Generator | None = None) -> None:
        self.runner, self.trie, self.mode, self.n, self.generator = (
            runner, trie, mode, n, generator)
        self.tree: BeamTree | None = None

    def start(self, prompt: list[int]) -> None:
        self.tree = BeamTree(self.runner, prompt)

    def propose(self, committed: list[Beam], g: int) -> dict:
        """``g`` levels from ``committed``: ``{"levels": [[beam, ...], ...]}`` plus, for
        relaxed rounds, ``"q"``: each level's ``[(sequence, q), ...]``."""
        if self.mode == "strict":
            return {"levels": draft_beam_levels(self.tree, committed, self.trie, self.n, g)}
        seqs, q = draft_sampled_levels(self.tree, [b[0] for b in committed], self.trie,
                                       self.n, g, self.generator)
        return {"levels": [[(s, 0.0) for s in level] for level in seqs],
                "q": [list(d.items()) for d in q]}

    def cached_tokens(self) -> int:
        return self.runner.length

    def release(self) -> None:
        self.runner.release()


class BeamTargetSide:
    """The target recommender of one request: ``start(prompt)``, then ``verify``."""

    def __init__(self, runner: ModelRunner, trie: ItemTrie, mode: Mode, k: int,
                 generator: torch.Generator | None = None) -> None:
        self.runner, self.trie, self.mode, self.k, self.generator = (
            runner, trie, mode, k, generator)
        self.tree: BeamTree | None = None

    def start(self, prompt: list[int]) -> None:
        check_beam_prompt(prompt, self.trie, self.k, self.runner)
        self.tree = BeamTree(self.runner, prompt)

    def verify(self, committed: list[Beam], proposal: dict) -> tuple[list[Beam], int]:
        """The new committed beams and the accepted steps of one round."""
        levels = [[(tuple(s), float(sc)) for s, sc in level] for level in proposal["levels"]]
        if self.mode == "strict":
            return verify_beam_levels(self.tree, committed, levels, self.trie, self.k)
        q = [{tuple(s): float(p) for s, p in pairs} for pairs in proposal["q"]]
        seqs, accepted = verify_sampled_levels(
            self.tree, [b[0] for b in committed], [[b[0] for b in lv] for lv in levels], q,
            self.trie, self.k, self.generator)
        return [(s, 0.0) for s in seqs], accepted

    def result(self, committed: list[Beam]) -> list[Beam]:
        """The final beams, ranked (relaxed: by the target's log-probability)."""
        if self.mode == "strict":
            return committed
        return ranked(self.tree, self.trie, [b[0] for b in committed])

    def cached_tokens(self) -> int:
        return self.runner.length

    def release(self) -> None:
        self.runner.release()


@dataclass
class BeamPropose:
    committed: list[Beam]
    g: int


@dataclass
class BeamVerify:
    committed: list[Beam]
    proposal: dict


def beam_rounds(length: int, gamma: int, stats: BeamSDStats
                ) -> Generator[BeamPropose | BeamVerify, object, list[Beam]]:
    """The beam SD loop: yields what it needs from the sides, records the stats, returns
    the committed beams once they are ``length`` tokens long."""
    committed: list[Beam] = [((), 0.0)]
    step = 0
    while step < length:
        proposal = yield BeamPropose(committed, min(gamma, length - step))
        committed, accepted = yield BeamVerify(committed, proposal)
        stats.target_calls += 1
        stats.drafted_beams += sum(len(level) for level in proposal["levels"])
        stats.accepted_steps += accepted
        stats.accepted_per_round.append(accepted)
        step = len(committed[0][0])
    stats.steps = step
    return committed


def run_beam_sd(mode: Mode, target: ModelRunner, draft: ModelRunner, prompt: list[int],
                trie: ItemTrie, k: int, n: int, gamma: int,
                generator: torch.Generator | None = None) -> tuple[list[Beam], BeamSDStats]:
    """Beam SD in process: the target's top-``k`` beams (strict) or ``k`` sampled beams
    ranked by the target (relaxed), with the search's stats."""
    tgt = BeamTargetSide(target, trie, mode, k, generator)
    tgt.start(prompt)  # checks the prompt, the trie and k
    check_beam_args(mode, k, n, gamma)
    stats, d_calls0 = BeamSDStats(), draft.calls
    drf = BeamDraftSide(draft, trie, mode, n, generator)
    drf.start(prompt)
    loop = beam_rounds(trie.length, gamma, stats)
    reply: object = None
    while True:
        try:
            msg = loop.send(reply)
        except StopIteration as stop:
            committed = stop.value
            break
        if isinstance(msg, BeamPropose):
            reply = drf.propose(msg.committed, msg.g)
        else:
            reply = tgt.verify(msg.committed, msg.proposal)
    stats.draft_calls = draft.calls - d_calls0
    return tgt.result(committed), stats

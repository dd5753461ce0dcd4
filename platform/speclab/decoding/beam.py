"""Constrained beam search and beam speculative decoding (AtSpeed, N-to-K verification).

A beam is ``(tokens, score)``: the item-id tokens generated so far after the prompt and
their summed log-probability, each step's log-probabilities renormalised over the tokens
the :class:`~speclab.decoding.trie.ItemTrie` allows. Ranking ties break by token sequence, so
every search here is deterministic.

* :func:`constrained_beam_search` — the target's (or drafter's) own beam search;
  beams share the prompt's KV cache and are expanded with tree attention.
* :func:`beam_speculative_search` — each round the drafter runs beam search with beam
  ``N`` for ``gamma`` steps from the committed beams; every drafted beam sequence and the
  committed beams are merged into ONE TokenTree and scored by ONE target forward; strict
  top-K verification (AtSpeed Algorithm 1) accepts step ``s`` iff the target's top-K at
  ``s`` are all among the drafted beams at ``s``. The target's top-K at the first
  rejected step (or one step past the last accepted) is committed as well, so the
  result is exactly the target's own beam search (lossless).
"""

from __future__ import annotations

import torch

from speclab.decoding.beam_levels import (
    Beam,
    BeamSDStats,
    BeamTree,
    check_beam_prompt,
    expand_beams,
    ranked,
    sample_beams,
    step_distribution,
)
from speclab.decoding.beam_loop import run_beam_sd
from speclab.decoding.runner import ModelRunner
from speclab.decoding.trie import ItemTrie


def constrained_beam_search(
    runner: ModelRunner, prompt: list[int], trie: ItemTrie, k: int
) -> tuple[list[Beam], int]:
    """Beam search of width ``k`` over the trie's ``L`` steps.

    Returns the final ``k`` beams (best first) and the number of model forwards.
    """
    check_beam_prompt(prompt, trie, k, runner)
    calls0 = runner.calls
    bt = BeamTree(runner, prompt)
    beams: list[Beam] = [((), 0.0)]
    for _ in range(trie.length):
        logits = bt.score([b[0] for b in beams])
        beams = expand_beams(beams, logits, trie, k)
    return beams, runner.calls - calls0


def mixture_beam_search(
    target: ModelRunner, draft: ModelRunner, prompt: list[int], trie: ItemTrie, k: int,
    lam: float,
) -> list[Beam]:
    """Beam search of width ``k`` under the per-step mixture ``(1-lam) q + lam p``.

    ``p`` is the target's and ``q`` the drafter's next-token distribution (AtSpeed
    eq. 3's alignment data, "target-LLM-mixed sampling" of MiniLLM); ``lam = 1`` is the
    target's own :func:`constrained_beam_search`, ``lam = 0`` the drafter's. Scores are
    summed log mixture probabilities, renormalised over the trie's valid tokens.
    """
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lambda: must be in [0, 1], got {lam}")
    check_beam_prompt(prompt, trie, k, target)
    trees = BeamTree(target, prompt), BeamTree(draft, prompt)
    beams: list[Beam] = [((), 0.0)]
    for _ in range(trie.length):
        seqs = [b[0] for b in beams]
        p = [x.float().softmax(-1) for x in trees[0].score(seqs)]
        q = [x.float().softmax(-1) for x in trees[1].score(seqs)]
        mix = [(lam * pi + (1 - lam) * qi).clamp_min(1e-30).log() for pi, qi in zip(p, q)]
        beams = expand_beams(beams, mix, trie, k)
    return beams


def beam_speculative_search(
    target: ModelRunner,
    draft: ModelRunner,
    prompt: list[int],
    trie: ItemTrie,
    k: int,
    n: int,
    gamma: int,
) -> tuple[list[Beam], BeamSDStats]:
    """Beam SD with strict top-K verification; returns the target's top-``k`` beams."""
    return run_beam_sd("strict", target, draft, prompt, trie, k, n, gamma)


# --- relaxed sampling verification (AtSpeed Algorithm 2; RELAXED: approximately, not
# exactly, the target's sampling beam search) ---


def sampling_beam_search(runner: ModelRunner, prompt: list[int], trie: ItemTrie, k: int,
                         generator: torch.Generator | None = None) -> list[Beam]:
    """The target's sampling-based beam search: at every step ``k`` sequences are drawn
    (without replacement) from the sequence distribution over the extensions of the
    current beams. Returns ``k`` beams ranked by the model's log-probability."""
    check_beam_prompt(prompt, trie, k, runner)
    bt = BeamTree(runner, prompt)
    beams: list[tuple[int, ...]] = [()]
    for _ in range(trie.length):
        cands, probs = step_distribution(bt, trie, beams)
        beams = sample_beams(cands, probs, k, generator)
    return ranked(bt, trie, beams)  # needs logits at proper prefixes only (all scored)


def beam_speculative_sampling(
    target: ModelRunner, draft: ModelRunner, prompt: list[int], trie: ItemTrie, k: int,
    gamma: int, generator: torch.Generator | None = None, n: int | None = None,
) -> tuple[list[Beam], BeamSDStats]:
    """Beam SD with relaxed sampling verification (AtSpeed Algorithm 2).

    Each round the drafter samples ``n`` (default ``k``) sequences per step from its
    sequence distribution ``q_j`` over the extensions of its previous step's samples,
    for ``gamma`` steps; one target forward scores them all. At step ``j`` each drafted
    sequence is accepted with ``min(1, p_j(y)/q_j(y))`` (``p_j``: the target's sequence
    distribution over the same extensions). If at least ``k`` are accepted the step is
    accepted and ``k`` of them, chosen at random, are its output; otherwise the missing
    ones are resampled from ``norm(max(0, p_j - q_j))`` (accepted ones zeroed) and the
    round ends. After ``gamma`` accepted steps the target samples one bonus step.
    Returns the final ``k`` beams ranked by the target's log-probability.
    """
    return run_beam_sd("relaxed", target, draft, prompt, trie, k, k if n is None else n,
                       gamma, generator)

"""The pieces every AtSpeed beam search is built of (:mod:`speclab.decoding.beam` runs the
searches, :mod:`speclab.decoding.beam_loop` the beam-SD rounds): beams over a cached
prompt (:class:`BeamTree`), one-step expansions and sequence distributions under an
:class:`~speclab.decoding.trie.ItemTrie`, and the drafter's and the target's halves of a
beam-SD round, strict (Algorithm 1: :func:`draft_beam_levels` /
:func:`verify_beam_levels`) and relaxed (Algorithm 2: :func:`draft_sampled_levels` /
:func:`verify_sampled_levels`).

A beam is ``(tokens, score)``: the item-id tokens generated so far after the prompt and
their summed log-probability, each step's log-probabilities renormalised over the tokens
the trie allows. Ranking ties break by token sequence, so every search is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from speclab.decoding.runner import ModelRunner, forward_tree_nodes
from speclab.decoding.sampling import draw
from speclab.decoding.tree import TokenTree
from speclab.decoding.trie import ItemTrie

Beam = tuple[tuple[int, ...], float]


def expand_beams(beams: list[Beam], logits: list[torch.Tensor], trie: ItemTrie,
                 width: int) -> list[Beam]:
    """Top-``width`` one-token extensions of ``beams`` (``logits[i]``: ``[V]`` at beam i)."""
    cands: list[Beam] = []
    for (seq, score), row in zip(beams, logits):
        allowed = trie.allowed(seq)
        if not allowed:
            continue
        lp = row.float()[allowed].log_softmax(-1).tolist()
        cands += [(seq + (tok,), score + v) for tok, v in zip(allowed, lp)]
    cands.sort(key=lambda b: (-b[1], b[0]))
    return cands[:width]


def check_beam_prompt(prompt: list[int], trie: ItemTrie, k: int, runner: ModelRunner) -> None:
    """A beam-search prompt must be non-empty token ids of the model; ``k >= 1``."""
    if not prompt:
        raise ValueError("history: must contain at least one token")
    if k < 1:
        raise ValueError(f"k: must be >= 1, got {k}")
    bad = [t for t in prompt if not 0 <= t < runner.vocab_size]
    if bad:
        raise ValueError(f"history: token ids {bad[:5]} outside the vocabulary")


class BeamTree:
    """Beams as nodes of a TokenTree over a cached prompt (root = last prompt token).

    ``score(seqs)`` returns the model's logits ``[V]`` at the end of each beam sequence,
    processing every node not yet seen in ONE forward with tree attention; ``logits``
    keeps them by sequence; ``restart()`` drops the beams but keeps the prompt's cache.
    """

    def __init__(self, runner: ModelRunner, prompt: list[int]) -> None:
        self.runner = runner
        runner.reset()
        self.root_logits = runner.forward(torch.tensor(prompt, dtype=torch.long))[-1]
        self.base = runner.length
        self.tree = TokenTree(prompt[-1])
        self.node: dict[tuple[int, ...], int] = {(): 0}
        self.slot: dict[int, int] = {0: self.base - 1}
        self.logits: dict[tuple[int, ...], torch.Tensor] = {(): self.root_logits}

    def restart(self) -> None:
        """Drop every beam node (keep the prompt's cache)."""
        self.runner.crop(self.base)
        self.tree = TokenTree(self.tree.tokens[0])
        self.node, self.slot = {(): 0}, {0: self.base - 1}
        self.logits = {(): self.root_logits}

    def add(self, seqs: list[tuple[int, ...]]) -> list[int]:
        """Add beam sequences (and missing prefixes) as nodes; returns new node ids."""
        new = []
        for seq in sorted(seqs, key=len):
            for i in range(1, len(seq) + 1):
                if seq[:i] not in self.node:
                    self.node[seq[:i]] = self.tree.add(seq[i - 1], self.node[seq[: i - 1]])
                    new.append(self.node[seq[:i]])
        return new

    def score(self, seqs: list[tuple[int, ...]]) -> list[torch.Tensor]:
        """Logits at the end of each sequence; processes missing nodes in ONE forward."""
        self.add(seqs)
        todo = sorted({self.node[s[:i]] for s in seqs for i in range(1, len(s) + 1)}
                      - set(self.slot))
        if todo:
            out = forward_tree_nodes(self.runner, self.tree, todo, self.base, self.slot)
            inv = {n: s for s, n in self.node.items()}
            for row, n in enumerate(todo):
                self.logits[inv[n]] = out[row]
        return [self.logits[s] for s in seqs]


@dataclass
class BeamSDStats:
    """Per-search counters: ``accepted_steps`` (AS@K's numerator), ``target_calls`` (one
    verification forward per round; the prompt's prefill is not counted)."""

    steps: int = 0
    accepted_steps: int = 0
    target_calls: int = 0
    draft_calls: int = 0
    drafted_beams: int = 0
    accepted_per_round: list[int] = field(default_factory=list)


def draft_beam_levels(drf: BeamTree, committed: list[Beam], trie: ItemTrie, n: int,
                      g: int) -> list[list[Beam]]:
    """The drafter's half of a beam-SD round: constrained beam search with beam ``n``
    for ``g`` steps from the ``committed`` beams; returns the beams of every step."""
    drf.restart()
    drafted: list[list[Beam]] = []
    beams = committed
    for _ in range(g):
        beams = expand_beams(beams, drf.score([b[0] for b in beams]), trie, n)
        drafted.append(beams)
    return drafted


def verify_beam_levels(tgt: BeamTree, committed: list[Beam], drafted: list[list[Beam]],
                       trie: ItemTrie, k: int) -> tuple[list[Beam], int]:
    """The target's half (Algorithm 1): committed + every drafted beam in ONE forward
    with tree attention, then the target's own top-``k`` step by step while all of it
    was drafted. Returns the new committed beams (one target step past the last
    accepted step) and the number of accepted steps."""
    tgt.restart()
    tgt.score([b[0] for b in committed] + [b[0] for level in drafted for b in level])
    step = len(committed[0][0])
    cur, accepted = committed, 0
    for level in drafted:
        top = expand_beams(cur, [tgt.logits[b[0]] for b in cur], trie, k)
        cur = top
        drafted_seqs = {b[0] for b in level}
        if all(b[0] in drafted_seqs for b in top):
            accepted += 1
            continue
        break
    else:  # every drafted step accepted: one more step from logits already computed
        if step + len(drafted) < trie.length:
            cur = expand_beams(cur, [tgt.logits[b[0]] for b in cur], trie, k)
    return cur, accepted


def _seq_logp(bt: BeamTree, trie: ItemTrie, seq: tuple[int, ...]) -> float:
    """The model's constrained log-probability of ``seq`` (all prefixes must be scored)."""
    total = 0.0
    for i, tok in enumerate(seq):
        allowed = trie.allowed(seq[:i])
        lp = bt.logits[seq[:i]].float()[allowed].log_softmax(-1)
        total += float(lp[allowed.index(tok)])
    return total


def step_distribution(bt: BeamTree, trie: ItemTrie, beams: list[tuple[int, ...]]):
    """Candidates one token past ``beams`` and the model's sequence distribution over them."""
    bt.score(beams)  # logits at every beam (and its prefixes) are now known
    cands = [b + (t,) for b in beams for t in trie.allowed(b)]
    logp = torch.tensor([_seq_logp(bt, trie, c) for c in cands])
    return cands, logp.softmax(-1)


def sample_beams(cands: list, probs: torch.Tensor, k: int, g: torch.Generator | None) -> list:
    """``k`` of ``cands`` drawn without replacement from ``probs`` (at most as many as
    have a non-zero probability)."""
    k = min(k, int((probs > 0).sum()))
    idx = draw(probs, k, g).tolist()
    return [cands[i] for i in idx]


def ranked(bt: BeamTree, trie: ItemTrie, seqs: list[tuple[int, ...]]) -> list[Beam]:
    """Complete sequences as beams ranked by the model's log-probability."""
    beams = [(s, _seq_logp(bt, trie, s)) for s in seqs]
    return sorted(beams, key=lambda b: (-b[1], b[0]))


def draft_sampled_levels(drf: BeamTree, committed: list[tuple[int, ...]], trie: ItemTrie,
                         n: int, g: int, generator: torch.Generator | None
                         ) -> tuple[list[list[tuple[int, ...]]], list[dict]]:
    """The drafter's half of a relaxed round: ``n`` sequences sampled per step from its
    sequence distribution ``q_j`` over the extensions of its previous step's samples, for
    ``g`` steps. Returns the samples of every step and each step's ``q_j`` (candidate ->
    probability)."""
    drf.restart()
    drafted, q_dists, cur = [], [], committed
    for _ in range(g):
        cands, q = step_distribution(drf, trie, cur)
        cur = sample_beams(cands, q, n, generator)
        drafted.append(cur)
        q_dists.append(dict(zip(cands, q.tolist())))
    return drafted, q_dists


def verify_sampled_levels(tgt: BeamTree, committed: list[tuple[int, ...]],
                          drafted: list[list[tuple[int, ...]]], q_dists: list[dict],
                          trie: ItemTrie, k: int, generator: torch.Generator | None
                          ) -> tuple[list[tuple[int, ...]], int]:
    """The target's half of a relaxed round (see
    :func:`speclab.decoding.beam.beam_speculative_sampling`): one forward over the
    committed and drafted sequences, acceptance step by step, the residual resampling at
    the first rejected step, or a bonus step. Returns the new committed sequences and the
    number of accepted steps."""
    tgt.restart()
    tgt.score(committed + [s for level in drafted for s in level])
    prev, accepted, rejected = committed, 0, False
    for level, q in zip(drafted, q_dists):
        cands, p = step_distribution(tgt, trie, prev)
        p_of = dict(zip(cands, p.tolist()))
        out = [y for y in level
               if float(torch.rand((), generator=generator)) <= p_of[y] / max(q[y], 1e-30)]
        want = min(k, len(cands))
        if len(out) >= want:
            pick = torch.randperm(len(out), generator=generator)[:want].tolist()
            committed, prev, accepted = [out[i] for i in sorted(pick)], level, accepted + 1
            continue
        resid = torch.tensor([max(0.0, p_of[c] - q.get(c, 0.0)) for c in cands])
        for y in out:
            resid[cands.index(y)] = 0.0
        if resid.sum() <= 0:  # numerically empty residual: fall back to p
            resid = p.clone()
            for y in out:
                resid[cands.index(y)] = 0.0
        committed = out + sample_beams(cands, resid / resid.sum(), want - len(out), generator)
        rejected = True
        break
    if not rejected and len(committed[0]) < trie.length:  # bonus step from the target
        cands, p = step_distribution(tgt, trie, committed)
        committed = sample_beams(cands, p, k, generator)
    return committed, accepted

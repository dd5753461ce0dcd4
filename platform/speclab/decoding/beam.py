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

from dataclasses import dataclass, field

import torch

from speclab.decoding.runner import ModelRunner, forward_tree_nodes
from speclab.decoding.sampling import draw
from speclab.decoding.tree import TokenTree
from speclab.decoding.trie import ItemTrie

Beam = tuple[tuple[int, ...], float]


def _expand(beams: list[Beam], logits: list[torch.Tensor], trie: ItemTrie,
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
        beams = _expand(beams, logits, trie, k)
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
        beams = _expand(beams, mix, trie, k)
    return beams


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
        beams = _expand(beams, drf.score([b[0] for b in beams]), trie, n)
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
        top = _expand(cur, [tgt.logits[b[0]] for b in cur], trie, k)
        cur = top
        drafted_seqs = {b[0] for b in level}
        if all(b[0] in drafted_seqs for b in top):
            accepted += 1
            continue
        break
    else:  # every drafted step accepted: one more step from logits already computed
        if step + len(drafted) < trie.length:
            cur = _expand(cur, [tgt.logits[b[0]] for b in cur], trie, k)
    return cur, accepted


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
    from speclab.decoding.beam_loop import run_beam_sd

    return run_beam_sd("strict", target, draft, prompt, trie, k, n, gamma)


# --- relaxed sampling verification (AtSpeed Algorithm 2; RELAXED: approximately, not
# exactly, the target's sampling beam search) ---


def _seq_logp(bt: BeamTree, trie: ItemTrie, seq: tuple[int, ...]) -> float:
    """The model's constrained log-probability of ``seq`` (all prefixes must be scored)."""
    total = 0.0
    for i, tok in enumerate(seq):
        allowed = trie.allowed(seq[:i])
        lp = bt.logits[seq[:i]].float()[allowed].log_softmax(-1)
        total += float(lp[allowed.index(tok)])
    return total


def _step_dist(bt: BeamTree, trie: ItemTrie, beams: list[tuple[int, ...]]):
    """Candidates one token past ``beams`` and the model's sequence distribution over them."""
    bt.score(beams)  # logits at every beam (and its prefixes) are now known
    cands = [b + (t,) for b in beams for t in trie.allowed(b)]
    logp = torch.tensor([_seq_logp(bt, trie, c) for c in cands])
    return cands, logp.softmax(-1)


def _sample(cands: list, probs: torch.Tensor, k: int, g: torch.Generator | None) -> list:
    k = min(k, int((probs > 0).sum()))
    idx = draw(probs, k, g).tolist()
    return [cands[i] for i in idx]


def ranked(bt: BeamTree, trie: ItemTrie, seqs: list[tuple[int, ...]]) -> list[Beam]:
    """Complete sequences as beams ranked by the model's log-probability."""
    beams = [(s, _seq_logp(bt, trie, s)) for s in seqs]
    return sorted(beams, key=lambda b: (-b[1], b[0]))


def sampling_beam_search(runner: ModelRunner, prompt: list[int], trie: ItemTrie, k: int,
                         generator: torch.Generator | None = None) -> list[Beam]:
    """The target's sampling-based beam search: at every step ``k`` sequences are drawn
    (without replacement) from the sequence distribution over the extensions of the
    current beams. Returns ``k`` beams ranked by the model's log-probability."""
    check_beam_prompt(prompt, trie, k, runner)
    bt = BeamTree(runner, prompt)
    beams: list[tuple[int, ...]] = [()]
    for _ in range(trie.length):
        cands, probs = _step_dist(bt, trie, beams)
        beams = _sample(cands, probs, k, generator)
    return ranked(bt, trie, beams)  # needs logits at proper prefixes only (all scored)


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
        cands, q = _step_dist(drf, trie, cur)
        cur = _sample(cands, q, n, generator)
        drafted.append(cur)
        q_dists.append(dict(zip(cands, q.tolist())))
    return drafted, q_dists


def verify_sampled_levels(tgt: BeamTree, committed: list[tuple[int, ...]],
                          drafted: list[list[tuple[int, ...]]], q_dists: list[dict],
                          trie: ItemTrie, k: int, generator: torch.Generator | None
                          ) -> tuple[list[tuple[int, ...]], int]:
    """The target's half of a relaxed round (see :func:`beam_speculative_sampling`): one
    forward over the committed and drafted sequences, acceptance step by step, the
    residual resampling at the first rejected step, or a bonus step. Returns the new
    committed sequences and the number of accepted steps."""
    tgt.restart()
    tgt.score(committed + [s for level in drafted for s in level])
    prev, accepted, rejected = committed, 0, False
    for level, q in zip(drafted, q_dists):
        cands, p = _step_dist(tgt, trie, prev)
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
        committed = out + _sample(cands, resid / resid.sum(), want - len(out), generator)
        rejected = True
        break
    if not rejected and len(committed[0]) < trie.length:  # bonus step from the target
        cands, p = _step_dist(tgt, trie, committed)
        committed = _sample(cands, p, k, generator)
    return committed, accepted


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
    from speclab.decoding.beam_loop import run_beam_sd

    return run_beam_sd("relaxed", target, draft, prompt, trie, k, k if n is None else n,
                       gamma, generator)

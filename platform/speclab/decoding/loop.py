"""The ONE decode loop: draft -> verify in ONE target call -> commit, over two sides.

:func:`rounds` is the loop itself, written once and free of I/O: a generator that yields
what it needs from the sides (:class:`Start`, :class:`Propose`, :class:`Verify`) and
receives their answers, and yields :class:`Committed` after each round. It records every
statistic (one definition of tau). A driver feeds it: :func:`drive` calls in-process
sides (:mod:`speclab.decoding.sides`); a Serve replica runs it per request with async
steps that batch concurrent requests (``serve_apps/decode.py``), and the batched engine
runs one generator per row in lockstep (:mod:`speclab.decoding.batch_loop`). Plain
decoding is the loop without a draft side.

Convention: the target's cache holds every committed token but the last one (the
root); each target call processes the root (plus the draft tree) and yields the next
token(s). Hence an autoregressive run makes exactly one target call per new token, and
``verification_rate = target_calls / new_tokens`` compares directly.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterable
from dataclasses import asdict, dataclass, field

import torch

from speclab.decoding.budget import RowBudget
from speclab.decoding.drafting import Drafter, DraftTraits
from speclab.decoding.rules import RuleSpec, resolve_rule
from speclab.decoding.runner import ModelRunner
from speclab.decoding.sampling import SamplingParams
from speclab.decoding.sides import (
    DraftSide,
    Proposal,
    TargetSide,
    VerifyResult,
    prefill,
    verify_round,
)

__all__ = ["Committed", "DraftSide", "GenerationStats", "Propose", "Proposal", "Start",
           "TargetSide", "Verify", "VerifyResult", "accept_at_least", "autoregressive_generate",
           "commit_tokens",
           "drive", "eos_set", "generate_tokens", "prefill", "rounds", "tau", "verify_round"]


@dataclass
class GenerationStats:
    """Counters for one generation (SpecDec++ eq. 2.3 naming).

    ``accepted_lengths[r]`` = tokens committed by round ``r`` (accepted drafts + 1);
    ``tau`` is their mean. ``acceptance_rate`` (alpha) = accepted draft tokens / draft
    tokens judged (depth positions where the rule looked at a draft token).
    """

    new_tokens: int = 0
    target_calls: int = 0
    draft_calls: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    judged_tokens: int = 0
    accepted_lengths: list[int] = field(default_factory=list)
    #: per round: draft tokens the target accepted (before any cut at EOS), the deepest
    #: draft position the round could reach (its draft budget; 0: no draft), and the
    #: draft tokens proposed (a tree's nodes; 0: no draft)
    round_accepted: list[int] = field(default_factory=list)
    round_reach: list[int] = field(default_factory=list)
    round_drafted: list[int] = field(default_factory=list)
    wall_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0

    def add_round(self, drafted: int, accepted: int, judged: int, committed: int) -> None:
        """Count one draft -> verify round (one target call) that committed
        ``committed`` tokens (accepted drafts + the bonus)."""
        self.target_calls += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.judged_tokens += judged
        self.accepted_lengths.append(committed)

    @property
    def tau(self) -> float:
        return tau(sum(self.accepted_lengths), len(self.accepted_lengths))

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.judged_tokens if self.judged_tokens else 0.0

    @property
    def discard_rate(self) -> float:
        """N_discarded / N."""
        n = self.new_tokens
        return (self.drafted_tokens - self.accepted_tokens) / n if n else 0.0

    @property
    def verification_rate(self) -> float:
        """N_target / N."""
        return self.target_calls / self.new_tokens if self.new_tokens else 0.0

    @property
    def other_s(self) -> float:
        return max(self.wall_s - self.draft_s - self.verify_s - self.prefill_s, 0.0)

    def to_dict(self) -> dict:
        """Plain dict with the derived rates (JSON-ready)."""
        d = asdict(self)
        for name in ("tau", "acceptance_rate", "discard_rate", "verification_rate", "other_s"):
            d[name] = getattr(self, name)
        return d


def eos_set(eos_token_id: int | Iterable[int] | None) -> set[int]:
    """A model config's ``eos_token_id`` (None, one id or several) as a set."""
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(t) for t in eos_token_id}


def commit_tokens(out: list[int], new: list[int], limit: int, eos: set[int]) -> bool:
    """Append ``new`` to ``out`` up to ``limit`` tokens or the first EOS; True when done."""
    for t in new:
        out.append(t)
        if t in eos or len(out) >= limit:
            return True
    return False


def accept_at_least(stats: list[GenerationStats], positions: int) -> list[float]:
    """Per draft position ``k = 1..positions``: the fraction of rounds that accepted at
    least ``k`` draft tokens, among the rounds that could reach ``k`` (a final round whose
    budget left fewer levels does not count against position ``k``; acceptance is the
    target's verdict, before any cut at EOS). NaN where no round could reach ``k``."""
    out = []
    for k in range(1, positions + 1):
        pairs = [(a, r) for s in stats for a, r in zip(s.round_accepted, s.round_reach,
                                                       strict=True) if r >= k]
        out.append(sum(a >= k for a, _ in pairs) / len(pairs) if pairs else float("nan"))
    return out


def tau(committed: int, rounds: int) -> float:
    """THE definition of tau (mean accepted length): tokens committed per round (accepted
    drafts + the bonus), i.e. per target call. Used by per-sequence stats and by every
    aggregate over prompts."""
    return committed / rounds if rounds else 0.0


@dataclass
class Start:
    """Prefill the target, then start the draft side (with the prefill top tokens it asks for)."""

    prompt_ids: list[int]


@dataclass
class Propose:
    """Ask the draft side for a tree: last round's accepted ``path`` (None at first) and
    committed tokens ``new``; at most ``budget`` levels. ``features``: the target's
    features on that path (feature drafters only, else None)."""

    path: list[int] | None
    new: list[int]
    budget: int
    features: object = None


@dataclass
class Verify:
    """Ask the target side to verify ``tree`` (None: the root alone)."""

    tree: object  # a TokenTree, its wire dict, or None


@dataclass
class Committed:
    """Tokens committed by the round that just ended (cut at EOS / the token limit) and,
    when the target side reports them, their log-prob entries (cut alike)."""

    tokens: list[int]
    done: bool
    logprobs: list | None = None


Message = Start | Propose | Verify | Committed


def check_max_new_tokens(max_new_tokens: int) -> None:
    if isinstance(max_new_tokens, bool) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens: must be > 0, got {max_new_tokens}")


def rounds(prompt_ids: list[int], max_new_tokens: int, eos: set[int], stats: GenerationStats,
           drafting: bool, policy: RowBudget | None = None
           ) -> Generator[Message, object, list[int]]:
    """The loop. Yields requests to the sides and receives their answers (``Start`` ->
    None, ``Propose`` -> :class:`Proposal`, ``Verify`` -> :class:`VerifyResult`,
    ``Committed`` -> None); returns the new tokens. ``drafting`` False: plain decoding.
    ``policy``: the ``auto`` budget (:mod:`speclab.decoding.budget`) that picks each
    round's levels; a round it gives none runs the root alone, and the next ``Propose``
    brings the draft side every token (and feature) committed since its last tree."""
    check_max_new_tokens(max_new_tokens)
    out: list[int] = []
    t_start = time.perf_counter()
    yield Start(list(prompt_ids))
    stats.prefill_s = time.perf_counter() - t_start
    path, new, feats, done = None, [], None, False
    try:
        while not done:
            # 1. draft: a tree rooted at the last committed token (none for the last token)
            t0 = time.perf_counter()
            budget = max_new_tokens - len(out) - 1
            if drafting and budget > 0 and policy is not None:
                budget = policy.choose(budget)
            tree = None
            if drafting and budget > 0:
                proposal = yield Propose(path, new, budget, feats)
                tree, stats.draft_calls = proposal.tree, proposal.draft_calls
            t1 = time.perf_counter()
            # 2. verify: one target forward over every node, the rule, the cache pruned
            v = yield Verify(tree)
            t2 = time.perf_counter()
            if policy is not None and drafting:
                policy.observe(budget if tree is not None else 0, v.accepted, v.drafted,
                               t2 - t0)
            # 3. commit (the draft side learns the accepted path with the next Propose; after
            # a round without a tree it learns the tokens since its last one)
            if tree is not None or path is None or not drafting:
                path, new, feats = v.path, v.new, v.features
            else:
                new = new + v.new
                feats = None if feats is None else torch.cat([feats, v.features])
            n0 = len(out)
            done = commit_tokens(out, v.new, max_new_tokens, eos)
            # 4. stats
            stats.draft_s += t1 - t0
            stats.verify_s += t2 - t1
            # committed = tokens this round really kept (none past EOS or the limit)
            stats.add_round(v.drafted, v.accepted, v.evaluated, len(out) - n0)
            stats.round_accepted.append(v.accepted)
            stats.round_reach.append(budget if tree is not None else 0)
            stats.round_drafted.append(v.drafted)
            stats.new_tokens = len(out)
            stats.wall_s = time.perf_counter() - t_start
            kept = len(out) - n0
            yield Committed(out[n0:], done, None if v.logprobs is None else v.logprobs[:kept])
    finally:
        if policy is not None:  # the sequence ended (or was closed early)
            policy.close()
    return out


def drive(loop: Generator[Message, object, list[int]], draft: DraftSide | None,
          target: TargetSide, prefill_top_k: int = 0) -> list[int]:
    """Run ``loop`` against in-process sides (one sequence); returns the new tokens.
    ``prefill_top_k``: top prefill tokens per prompt position the drafter reads."""
    reply: object = None
    while True:
        try:
            msg = loop.send(reply)
        except StopIteration as stop:
            return stop.value
        reply = None
        if isinstance(msg, Start):
            top = target.start(msg.prompt_ids, prefill_top_k if draft else 0)
            if draft is not None:
                draft.start(msg.prompt_ids, top, target.prefill_features)
        elif isinstance(msg, Propose):
            reply = draft.propose(msg.path, msg.new, msg.budget, msg.features)
        elif isinstance(msg, Verify):
            reply = target.verify(msg.tree)


def generate_tokens(
    target: ModelRunner,
    drafter: Drafter | None,
    prompt_ids: list[int],
    max_new_tokens: int,
    params: SamplingParams,
    rule: RuleSpec,
    eos_token_id: int | Iterable[int] | None = None,
    generator: torch.Generator | None = None,
    traits: DraftTraits | None = None,
    policy: RowBudget | None = None,
) -> tuple[list[int], GenerationStats]:
    """Decode one sequence in process (``drafter`` None: plain decoding; ``traits``: what
    its method reads from the target, ``MethodSpec.traits()``; ``generator``: the
    sequence's rng, shared by the drafter and the rule; ``policy``: the ``auto`` budget).
    Returns the new tokens and the stats."""
    traits = traits or DraftTraits()
    stats = GenerationStats()
    loop = rounds(prompt_ids, max_new_tokens, eos_set(eos_token_id), stats, drafter is not None,
                  policy)
    draft = DraftSide(drafter) if drafter is not None else None
    features = draft is not None and traits.needs_features
    out = drive(loop, draft, TargetSide(target, params, rule, generator, features,
                                        traits.feature_layers), traits.prefill_top_k)
    return out, stats


def autoregressive_generate(
    target: ModelRunner,
    prompt_ids: list[int],
    max_new_tokens: int,
    params: SamplingParams,
    eos_token_id: int | Iterable[int] | None = None,
    generator: torch.Generator | None = None,
) -> tuple[list[int], GenerationStats]:
    """Plain decoding with a KV cache (greedy or sampling). Returns new tokens and stats."""
    return generate_tokens(target, None, prompt_ids, max_new_tokens, params,
                           resolve_rule(None, None, params), eos_token_id, generator)

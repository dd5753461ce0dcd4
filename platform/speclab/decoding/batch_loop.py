"""The batched driver: THE loop (:func:`~speclab.decoding.loop.rounds`) for many rows.

Each row runs its own :func:`rounds` generator; the driver answers them in lockstep,
one batched call per side and message kind each tick, as the Serve draft replica does
over the network: every joining row's ``Start`` in ONE target prefill (and one draft
join), every ``Propose`` in one batched drafter call (:class:`~speclab.decoding.row_pool.
DraftPool`; a batched drafter drafts all rows in shared forwards), every ``Verify`` in
ONE target forward over every row's tree (:class:`~speclab.decoding.row_pool.TargetPool`:
ragged trees padded, per-row masks, rules, rngs and pruning). Rows that finish leave and
waiting prompts join between ticks (continuous batching, at most ``batch_size`` rows).

The driver keeps no commit, EOS, budget or statistics logic of its own: every row's
:class:`GenerationStats` come from its generator (one definition of tau);
:class:`BatchStats` adds the batch's own figures (forwards, wall time). At temperature 0
each row's tokens equal that prompt decoded alone.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Generator, Iterable
from dataclasses import dataclass, field, replace

from speclab.decoding.budget import AutoBudget
from speclab.decoding.loop import (
    Committed,
    GenerationStats,
    Message,
    Propose,
    Start,
    Verify,
    check_max_new_tokens,
    eos_set,
    rounds,
)
from speclab.decoding.row_pool import DraftPool, NewRow, TargetPool, seeded
from speclab.decoding.rules import RuleSpec
from speclab.decoding.sampling import SamplingParams


@dataclass
class BatchStats:
    """Figures of one batched run: ``target_forwards`` (batched target calls),
    ``draft_forwards``, the largest batch, the wall time and tokens of all rows."""

    rows: int = 0
    new_tokens: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    max_batch: int = 0
    wall_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s else 0.0

    def to_dict(self) -> dict:
        return {**self.__dict__, "tokens_per_s": self.tokens_per_s}


def new_rows(prompts: list[list[int]], sampling: SamplingParams, rule: RuleSpec,
             seed: int = 0) -> list[NewRow]:
    """One row per prompt (ids ``"0"``, ``"1"``, ...); prompt ``i`` samples with its own
    generator seeded ``seed + i``, shared by its drafter and its rule."""
    return [NewRow(str(i), list(p), sampling, rule, seeded(seed + i))
            for i, p in enumerate(prompts)]


@dataclass
class _Live:
    """A row in the batch: its loop, where the loop waits (``msg``), its stats."""

    index: int
    row: NewRow
    loop: Generator[Message, object, list[int]]
    stats: GenerationStats
    msg: Message | None = None
    out: list[int] = field(default_factory=list)

    def answer(self, reply: object) -> None:
        """Send ``reply`` to the loop and run it to its next request of a side (past the
        ``Committed`` notices); ``msg`` None once the loop returned."""
        try:
            msg = self.loop.send(reply)
            while isinstance(msg, Committed):
                msg = self.loop.send(None)
            self.msg = msg
        except StopIteration as stop:
            self.out, self.msg = stop.value, None


def generate_batch(
    target: TargetPool,
    draft: DraftPool | None,
    rows: list[NewRow],
    max_new_tokens: int,
    batch_size: int,
    eos_token_id: int | Iterable[int] | None = None,
    prefill_top_k: int = 0,
    policy: AutoBudget | None = None,
) -> tuple[list[list[int]], list[GenerationStats], BatchStats]:
    """Decode ``rows`` with at most ``batch_size`` of them at once (``draft`` None: plain
    decoding; ``prefill_top_k``: top prefill tokens per prompt position the drafter
    reads; ``policy``: the ``auto`` budget deciding each step's depth for every row).
    Returns per row its new tokens and stats (in order) and the batch's figures."""
    check_max_new_tokens(max_new_tokens)
    if isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
    eos = eos_set(eos_token_id)
    t_start = time.perf_counter()
    waiting = deque(enumerate(rows))
    live: list[_Live] = []
    done: dict[int, _Live] = {}
    batch = BatchStats(rows=len(rows))
    forwards0 = target.runner.calls
    draft0 = draft.calls if draft is not None else 0
    while waiting or live:
        for _ in range(min(batch_size - len(live), len(waiting))):
            i, row = waiting.popleft()
            stats = GenerationStats()
            mine = policy.row() if policy is not None and draft is not None else None
            x = _Live(i, row, rounds(row.prompt_ids, max_new_tokens, eos, stats,
                                     draft is not None, mine), stats)
            x.answer(None)
            live.append(x)
        batch.max_batch = max(batch.max_batch, len(live))
        if policy is not None:  # none waiting: the last rows' finish is what counts
            policy.backlog = bool(waiting)
        # 0. joining rows: one target prefill, one draft join
        starts = [x for x in live if isinstance(x.msg, Start)]
        if starts:
            tops = target.start([x.row for x in starts], prefill_top_k)
            if draft is not None:
                draft.join([replace(x.row, prefill_top=p.top, features=p.features)
                            for x, p in zip(starts, tops, strict=True)])
            for x in starts:
                x.answer(None)
        # 1. draft: every proposing row in one batched drafter call
        t0 = time.perf_counter()
        proposing = [x for x in live if isinstance(x.msg, Propose)]
        if proposing:
            proposals = draft.propose([(x.row.rid, x.msg.path, x.msg.new, x.msg.budget,
                                        x.msg.features) for x in proposing])
            for x, p in zip(proposing, proposals, strict=True):
                if isinstance(p, Exception):
                    raise p
                x.answer(p)
        t1 = time.perf_counter()
        # 2. verify: every row's tree in ONE target forward
        verifying = [x for x in live if isinstance(x.msg, Verify)]
        results = target.verify([(x.row.rid, x.msg.tree) for x in verifying])
        if policy is not None:  # the rows' next rounds share one new decision
            policy.next_step()
        for x, v in zip(verifying, results, strict=True):
            if isinstance(v, Exception):  # offline, one row's error ends the run (as alone)
                raise v
            x.answer(v)
        batch.draft_s += t1 - t0
        batch.verify_s += time.perf_counter() - t1
        # 3. finished rows leave
        for x in [x for x in live if x.msg is None]:
            target.end(x.row.rid)
            if draft is not None:
                draft.end(x.row.rid)
            done[x.index] = x
        live = [x for x in live if x.msg is not None]
    ordered = [done[i] for i in range(len(rows))]
    batch.new_tokens = sum(len(x.out) for x in ordered)
    batch.target_forwards = target.runner.calls - forwards0
    batch.draft_forwards = (draft.calls - draft0) if draft is not None else 0
    batch.wall_s = time.perf_counter() - t_start
    return [x.out for x in ordered], [x.stats for x in ordered], batch

"""The ``auto`` draft budget: before each batch step, the draft depth that maximises
expected committed tokens per second (0: plain decoding), from measured forward costs
and each sequence's running per-position acceptance.

ONE :class:`AutoBudget` decides for all the sequences decoded together (the rows of the
batched engine, the requests of a Serve replica; one sequence alone is a batch of one):
in a batched step every row waits for the slowest, so a row that skips drafting saves
nothing while the others draft; the step pays only when all rows decide alike. Each
sequence holds a :class:`RowBudget` (:meth:`AutoBudget.row`); the loop
(:func:`speclab.decoding.loop.rounds`) asks it for the round's budget in levels (a
chain's gamma, a tree's depth: the drafter drafts at most that many levels, with its
method's own width) and reports the round back. A decision holds until a round ends
(in lockstep: one decision per step). The choice uses only past rounds, so it never
changes what is decoded: at temperature 0 the output is plain decoding's, and when
sampling each round's rule is exact for whatever budget it was given.

The model of a step of depth ``d`` over the ``R`` live rows:

* expected committed tokens ``sum_rows E_r(d)``, ``E_r(d) = 1 + sum_{k<=d} prod_{j<=k}
  q_{r,j}``, with ``q_{r,j}`` row ``r``'s conditional acceptance at draft position ``j``
  (given ``j-1`` accepted), counted with a decay (recent rounds weigh more) on top of a
  prior (the drafter's measured acceptance, weight :attr:`AutoBudget.prior_weight`
  rounds);
* seconds ``T(d) = target(R, 1 + n(d)) * r0(R) + D(d)``: the target's calibrated cost
  curve (:mod:`speclab.calibration`) over the root and ``n(d)`` draft tokens per row (the
  running count at that depth, else ``w d`` with ``w`` the running nodes per level),
  times ``r0(R)``, the running ratio (the median of the last :attr:`AutoBudget.window`
  steps', as for ``D``) of a plain step's wall time to its forward at ``R``
  rows (the rule, the commit, the loop; at a batch size not measured, the nearest one
  measured's, before any 1); and ``D(d)``, the draft part: the running wall time a step
  of depth ``d`` took (:meth:`AutoBudget.step_s`) beyond its target part at the ``r0`` in
  force (the draft model or network, tree building; so a measured step's ``T(d)`` is
  what it took, whatever ``r0`` became since), for depths not measured a line through
  those measured, before any the draft model's curve times ``d`` (0 for model-free
  drafters);
* ``T(0) = target(R, 1) * r0(R)``, ``E_r(0) = 1``.

Both sides of the comparison are measured where the decision is made: ``r0`` is kept per
batch size (a plain step's cost beyond its curve is not the same at 1 row and at 16, and
the curve, calibrated at one context length, was 28% above a plain step of 4 rows), and
a drafting choice at a batch size with fewer than :attr:`AutoBudget.plain_probes` plain
steps measured is first replaced by one (at most :attr:`AutoBudget.plain_tries` there),
where the decision hangs on it:
where plain decoding would win with ``r0`` 30% below the estimate in use there
(:attr:`AutoBudget.r0_doubt`), or where no batch size within a factor of 2 has ``r0``
measured (the calibrated curve's error is not the same at 4 rows and at 15: a colocated
Serve replica borrowed 4 rows' 1.08 at 15 rows, where a plain step ran at about half its
curve, and drafted at 0.85x plain decoding's speed). A step in which sequences joined
or left (a driver's batch changed since its last step: a prefill, a cache cut, a new
shape's first forward, up to 2.5x a step on a CPU) teaches no step time: its one-off
costs would make plain decoding look dearer than it is (measured: a plain step of 16 rows
estimated at 12.5 ms where it took 9.5).

The decision is ``argmax_d sum_rows E_r(d) / T(d)`` (committed tokens per second: right
while new sequences wait to take the places of those that end, as in Serve). When none
wait (:attr:`AutoBudget.backlog` false: the offline engine's last rows), the batch ends
when its slowest row does, and a step that drafts makes rows advance unevenly: the
decision is then ``argmax_d min_{r in L} E_r(d) / T(d)`` over the laggards ``L`` (the rows
with the most tokens left, within 10% of the most: each row's remaining budget is the
limit it last asked with), so the depth is the one that brings the LAST row home soonest.
Where the prior and the calibrated curves say drafting pays, the first
:attr:`AutoBudget.warmup` decisions draft at once, before ``r0`` is measured at that batch
size. Where they say it does not, they draft as probes do (below): on one row
(:meth:`AutoBudget.drafts`; a warm-up of every row cost the draft model's prefill of
every prompt, batched drafters prefilling a row when it first drafts: 4% of a 48-token
run of SmolLM2 at 16 rows where plain decoding won every later step), at the depth and
only where a probe would (:meth:`AutoBudget.explore`; a one-row warm-up of EAGLE-3 on SmolLM2 at 16
rows padded every row's verification to the probed row's 17 tokens, two steps of about
twice a plain one's cost, where a prior measured over hundreds of rounds said drafting
could not pay). After
:attr:`AutoBudget.probe_every` decisions in a row of one choice, one step drafts at the
depth that wins most with every position's acceptance raised by
:meth:`AutoBudget.optimism` (``probe_z`` standard deviations of the live rows' acceptance
over the rounds behind it), where that differs from the choice: after plain steps, so
the acceptance estimates stay current; after drafting ones, deeper, so positions no step
drafted are measured rather than guessed from the prior. Where drafting loses even with
that acceptance no probe is spent (it could not change the decision, and it costs a draft
model's catch-up over the whole plain run). A probe after which the model keeps its
choice doubles the run the next one waits for (at most 8x), and a change of the model's
choice resets it. A drafted step in
which a row drafts after a plain round of its own, or for the first time, pays that
catch-up (or, batched drafters prefilling a row when it first drafts, its prompt's
prefill), so, like a step on a changed batch, its time is not learned (a depth first
measured there kept 30 ms where its steady steps took 5; EAGLE-3 on SmolLM2 at batch 1,
each prompt a new row, learned 23 ms for a depth-1 step that takes 2-9 and stopped
drafting). Pure Python: no Ray, no MLflow, no tensors.
"""

from __future__ import annotations

import functools
import itertools
import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

#: (rows, new tokens) -> seconds of one forward
Cost = Callable[[int, int], float]


@functools.lru_cache(maxsize=1024)
def batch_key(rows: int) -> int:
    """The batch size a step of ``rows`` rows learns its times under: ``rows`` up to 4,
    above it the largest of ``p``, ``1.25 p``, ``1.5 p`` (``p`` a power of 2) not above
    ``rows`` (13-15 rows: 12). In a Serve replica clients join and leave every few steps,
    so the rows of its steps wander over a few sizes (12-16 at 16 clients); kept per exact
    size, a step time was the median of one or two steps (a 15-row depth-1 step learned
    10.6 ms where 14 and 16 rows took 7.4 and 8.4), and a learned step prices the size it
    ran at by the target's curve (:meth:`AutoBudget.seconds`)."""
    if rows <= 4:
        return max(rows, 1)
    p = 1 << (rows.bit_length() - 1)
    return max(k for k in (p, p + p // 4, p + p // 2) if k <= rows)


@dataclass
class RoundCosts:
    """What a round's forwards cost: the target's curve and, when the drafter runs a
    model with a calibrated curve, that model's (per level: ``draft(rows, nodes)``)."""

    target: Cost
    draft: Cost | None = None


@dataclass
class Acceptance:
    """Counts per draft position (a row's, decayed; or a run's): rounds that judged it
    (drafted that deep with every position before it accepted), and that accepted it."""

    judged: list[float]
    hits: list[float]

    def rates(self, least: float = 0.0) -> list[float]:
        """Conditional acceptance ``q_k = hits_k / judged_k``, up to the first position
        judged by no round, or by fewer than ``least``."""
        out = []
        for j, h in zip(self.judged, self.hits, strict=True):
            if j <= 0 or j < least:
                break
            out.append(h / j)
        return out

    def plus(self, other: Acceptance) -> Acceptance:
        """Both counts together (over the longer one's positions)."""
        n = max(len(self.judged), len(other.judged))

        def pad(v: list[float]) -> list[float]:
            return list(v) + [0.0] * (n - len(v))
        return Acceptance([a + b for a, b in zip(pad(self.judged), pad(other.judged))],
                          [a + b for a, b in zip(pad(self.hits), pad(other.hits))])


def judged_counts(accepted: Sequence[int], reach: Sequence[int], depth: int) -> Acceptance:
    """The counts of rounds (each: draft tokens ``accepted`` out of a budget that could
    reach ``reach`` positions) at positions ``1..depth``."""
    judged, hits = [0.0] * depth, [0.0] * depth
    for a, r in zip(accepted, reach, strict=True):
        for k in range(1, min(r, depth) + 1):
            if a < k - 1:
                break
            judged[k - 1] += 1.0
            hits[k - 1] += float(a >= k)
    return Acceptance(judged, hits)


@dataclass
class AutoBudget:
    """The budget controller of sequences decoded together (see the module docstring).

    ``max_depth``: the method's own draft length (``MethodSpec.draft_length()``);
    ``prior``: conditional acceptance per position ``q_1..q_n`` (shorter: its last value
    repeats; empty: 0.5)."""

    costs: RoundCosts
    max_depth: int
    prior: Sequence[float] = ()
    #: the rounds behind the prior (:func:`judged_counts` of the runs that measured it):
    #: they start the ended rows' counts, so the prior's confidence is what was measured
    measured: Acceptance | None = None
    prior_weight: float = 4.0
    decay: float = 0.97
    probe_every: int = 16
    #: a probe is skipped while drafting loses even with acceptance this many standard
    #: deviations above its estimate (0: always probe)
    probe_z: float = 2.0
    warmup: int = 2
    #: plain steps measured per batch size (``r0`` is their median) before a drafting
    #: choice stands there. While a budget drafts, its plain steps are these alone: with
    #: one, a colocated chain replica at 12-15 rows priced a plain step at 5.2 ms where
    #: they took 3.7-4.1, and drafted at 0.84-0.97x plain decoding's speed
    plain_probes: int = 3
    #: at most this many plain steps per batch size spent measuring ``r0`` (a step on a
    #: changed batch measures nothing)
    plain_tries: int = 9
    #: such a plain step is spent only where plain decoding would win with ``r0`` at this
    #: fraction of the estimate in use there (the nearest batch size's): where drafting
    #: wins even then, measuring ``r0`` could not change the decision (0: always measure)
    r0_doubt: float = 0.7
    width: float = 1.0  # draft nodes per level (per row)
    #: whether sequences wait to join (throughput objective) or not (the slowest row's)
    backlog: bool = True
    #: the ratio of a plain step's wall seconds to its target forward's curve where no
    #: batch size is measured
    plain_ratio: float = 1.0
    #: per batch size (:func:`batch_key`): running ratio of a plain step's wall seconds
    #: to its curve
    plain_ratios: dict[int, float] = field(default_factory=dict)
    #: per (batch size, depth) (:func:`batch_key`): running ratio of a drafted step's wall
    #: seconds to the target's curve over its tokens (so a step learned at 13 rows prices
    #: one of 15). Its draft part (:meth:`draft_s`) is what it took beyond its target
    #: part, read against the ``r0`` in force when asked. A part fixed when the step was
    #: learned kept the ``r0`` of then, and once ``r0`` was measured at that batch size
    #: the model's step no longer cost what the step had cost (a colocated chain replica
    #: at 15 rows learned 3 ms against an ``r0`` of 1.08 borrowed from 4 rows; measured
    #: there, ``r0`` was about 0.5, and the model priced a 12 ms step at 8). Per batch
    #: size too: a Serve replica's budget lives through every batch size its clients
    #: bring, and a draft part learned at one row (EAGLE's tree on the reference pair:
    #: 5 ms) priced the same depth at 14 rows (33 ms there), where its steps, rows
    #: joining all the time, seldom teach one
    step_ratios: dict[tuple[int, int], float] = field(default_factory=dict)
    #: the running step times above are the median of this many recent steps (a running
    #: mean moved by a wall-time outlier: one 38 ms depth-1 step of EAGLE-3 on SmolLM2,
    #: among steady ones of 1-9 ms, lifted a mean with weight 0.2 from 3 to 11 ms)
    window: int = 9
    #: per depth: running number of draft tokens a row's round of that budget proposed
    nodes: dict[int, float] = field(default_factory=dict)
    decisions: list[int] = field(default_factory=list)  # every step's depth
    _rows: dict[int, Acceptance] = field(default_factory=dict)
    _left: dict[int, int] = field(default_factory=dict)  # row -> tokens it may still draft
    #: the counts of the rows that ended (decayed as they are added): every later row's
    #: prior, so what earlier requests measured carries over
    _ended: Acceptance | None = None
    _keys: itertools.count = field(default_factory=itertools.count)
    #: a driver marks its batch steps (:meth:`next_step`): one decision per step; else a
    #: decision per round (one sequence alone)
    driven: bool = False
    _decision: int | None = None
    _step: int = 0
    _decided_at: int = -1
    _observed: bool = False  # a round ended since the last decision
    _timed: bool = False  # the current decision's step time is in already
    _choice: int | None = None  # the model's own last choice (before probes)
    _run: int = 0  # decisions in a row of that choice
    #: a row drafts in this step after a plain round of its own, or for the first time:
    #: the step's draft part includes that row's catch-up over every token committed
    #: since its last round (or its prompt's prefill: batched drafters prefill a row when
    #: it first drafts), not a steady draft step's cost, so its time is not learned
    _catching_up: bool = False
    #: the driver's step (``_step``) in which sequences last joined or left: the next
    #: step carries their one-off costs and teaches no step time
    _churned: int = -1
    _dirty: bool = False  # the step being reported ran on a changed batch
    _curves: dict = field(default_factory=dict)  # (side, rows, tokens) -> seconds
    _plain_probes: dict = field(default_factory=dict)  # batch key -> plain steps measuring
    _probe_gap: int = 0  # decisions of one choice in a row before a probe (0: probe_every)
    _probing: bool = False  # the decision in force is a probe
    _probers: set | None = None  # the rows the probe drafts (chosen when the first asks)
    _recent: dict = field(default_factory=dict)  # (name, key) -> its last ``window`` values

    def __post_init__(self) -> None:
        if isinstance(self.max_depth, bool) or self.max_depth < 1:
            raise ValueError(f"budget: auto needs a method with a draft length >= 1, got "
                             f"{self.max_depth}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"budget: window must be a whole number of steps >= 1, got "
                             f"{self.window!r}")
        if not 0.0 <= self.r0_doubt <= 1.0:
            raise ValueError(f"budget: r0_doubt must be within [0, 1] (0: always measure "
                             f"r0 first), got {self.r0_doubt!r}")
        if self.measured is not None:  # the prior's rounds, at this method's positions
            d, m = self.max_depth, self.measured
            self._ended = Acceptance((list(m.judged) + [0.0] * d)[:d],
                                     (list(m.hits) + [0.0] * d)[:d])

    # ------------------------------------------------------------------ rows
    def row(self) -> RowBudget:
        """A new sequence's handle (its own acceptance; the shared decision)."""
        key = next(self._keys)
        self._rows[key] = Acceptance([0.0] * self.max_depth, [0.0] * self.max_depth)
        self._churned = self._step
        return RowBudget(self, key)

    def q(self, k: int, key: int | None = None) -> float:
        """Estimated acceptance at position ``k`` (1-based) given ``k - 1`` accepted, of
        row ``key`` (None: the prior alone). The prior is ``prior`` updated by the rows
        that ended."""
        prior = self.prior[min(k, len(self.prior)) - 1] if self.prior else 0.5
        w = self.prior_weight
        if self._ended is not None:
            prior = (self._ended.hits[k - 1] + w * prior) / (self._ended.judged[k - 1] + w)
        acc = self._rows.get(key) if key is not None else None
        if acc is None:
            return prior
        return (acc.hits[k - 1] + w * prior) / (acc.judged[k - 1] + w)

    def _priors(self, top: int) -> list[float]:
        """:meth:`q` without a row (the prior) at positions ``1..top``."""
        return [self.q(k) for k in range(1, top + 1)]

    def optimism(self, z: float) -> list[float]:
        """Per draft position, what an optimistic estimate adds to every row's :meth:`q`:
        ``z`` standard deviations of the live rows' mean acceptance, as a binomial sample
        of the rounds behind it (the live rows', the prior's weight and the ended rows':
        their counts move every row's prior, so they narrow it too; decayed as they are
        added, they weigh about the last 30 rows' rounds at most), plus ``z / (n + 1)``
        (a width where the rate is 0 or 1). The prior's own rounds (:attr:`measured`)
        start the ended rows' counts: a prior measured over hundreds of rounds no longer
        weighs 4, which put the bound of a SmolLM2 draft measured at 0.2 near 0.96."""
        out = []
        ended = self._ended
        for k in range(1, self.max_depth + 1):
            n = self.prior_weight + sum(a.judged[k - 1] for a in self._rows.values())
            n += ended.judged[k - 1] if ended is not None else 0.0
            m = sum(self.q(k, key) for key in self._rows) / len(self._rows) if self._rows \
                else self.q(k)
            out.append(z * (m * (1.0 - m) / (n + 1.0)) ** 0.5 + z / (n + 1.0))
        return out

    def expected_tokens(self, depth: int, key: int | None = None,
                        boost: Sequence[float] = ()) -> float:
        """``E(depth)``: expected tokens a round of that depth commits for row ``key``
        (``boost``: added to each position's acceptance, :meth:`optimism`)."""
        return self.expected_all(depth, key, boost)[depth]

    def expected_all(self, top: int, key: int | None = None,
                     boost: Sequence[float] = (),
                     priors: Sequence[float] | None = None) -> list[float]:
        """``[E(0), ..., E(top)]`` for row ``key`` in one pass over the positions (what
        :meth:`rates` asks for every depth; :meth:`expected_tokens` is one of them).
        ``priors``: :meth:`q` without a row at positions ``1..top``, when the caller has
        them (every row shares them: :meth:`rates` computes them once per call)."""
        if priors is None:
            priors = self._priors(top)
        acc = self._rows.get(key) if key is not None else None
        w = self.prior_weight
        out, total, p = [1.0], 1.0, 1.0
        for k in range(1, top + 1):
            q = priors[k - 1] if acc is None else (
                (acc.hits[k - 1] + w * priors[k - 1]) / (acc.judged[k - 1] + w))
            p *= min(q + (boost[k - 1] if boost else 0.0), 1.0)
            total += p
            out.append(total)
        return out

    # ------------------------------------------------------------------ time
    def curve(self, side: str, rows: int, tokens: int) -> float:
        """``costs.<side>(rows, tokens)`` (side: ``target`` or ``draft``), looked up once
        per point: the calibrated curves do not change while a budget lives, and their
        interpolation was a quarter of a batch step's decision."""
        key = (side, rows, tokens)
        out = self._curves.get(key)
        if out is None:
            out = self._curves[key] = getattr(self.costs, side)(rows, tokens)
        return out

    def ratio(self, rows: int) -> float:
        """``r0(rows)``: the running ratio of a plain step of ``rows`` rows to its curve
        (learned under :func:`batch_key`); at a batch size not measured, that of the
        nearest one measured (in log rows), before any :attr:`plain_ratio`."""
        key = batch_key(rows)
        if key in self.plain_ratios:
            return self.plain_ratios[key]
        if not self.plain_ratios:
            return self.plain_ratio
        return self.plain_ratios[_nearest(self.plain_ratios, key)]

    def step_s(self, depth: int, rows: int) -> float | None:
        """The running wall seconds of a drafted step of ``depth`` at ``rows`` rows where
        its batch size (:func:`batch_key`) measured one, priced at ``rows`` by the
        target's curve; else None."""
        r = self.step_ratios.get((batch_key(rows), depth))
        if r is None:
            return None
        nodes = self.nodes.get(depth, self.width * depth)
        return r * self.curve("target", rows, 1 + round(nodes))

    def verify_s(self, depth: int, rows: int, nodes: float | None = None) -> float:
        """Seconds of the step's target part: the curve's forward over the root and
        ``nodes`` draft tokens per row (default: the running count at that depth, else
        ``width * depth``), times the plain-step ratio at ``rows`` (:meth:`ratio`)."""
        if nodes is None:
            nodes = self.nodes.get(depth, self.width * depth)
        return self.curve("target", rows, 1 + round(nodes)) * self.ratio(rows)

    def draft_s(self, depth: int, rows: int) -> float:
        """Seconds of the step's draft part at ``depth`` with ``rows`` rows: measured
        there, else a line through the depths measured at ``rows`` (one measured depth:
        proportional to depth); at a batch size with none measured, that estimate at the
        nearest one measured (in log rows), scaled by the draft model's curve from there
        to ``rows``, or without a curve in proportion to the rows (a batched draft part
        grows at most that fast: more rows, more per-row tree work, never less per row);
        with nothing measured, ``depth`` forwards of the draft model's curve (0 for
        drafters without one). 0 at depth 0."""
        if depth == 0:
            return 0.0
        measured = {r for r, _ in self.step_ratios}
        if not measured:
            if self.costs.draft is None:
                return 0.0
            return depth * self.curve("draft", rows, max(round(self.width), 1))
        key = batch_key(rows)
        if key in measured:
            return self._draft_at(depth, rows)
        near = _nearest(measured, key)
        part = self._draft_at(depth, near)
        if self.costs.draft is not None:
            w = max(round(self.width), 1)
            return part * self.curve("draft", rows, w) / max(self.curve("draft", near, w),
                                                             1e-12)
        return part * rows / near

    def _draft_at(self, depth: int, rows: int) -> float:
        """The draft part at ``depth`` from the depths measured at ``rows``' batch size
        (some are): a measured step's time beyond its target part (:meth:`verify_s`, at
        the ``r0`` in force), else a line through those parts (one: proportional to
        depth)."""
        t = self.step_s(depth, rows)
        if t is not None:  # measured there
            return max(t - self.verify_s(depth, rows), 0.0)
        pts = []
        for d in range(1, self.max_depth + 1):
            t = self.step_s(d, rows)
            if t is not None:
                pts.append((d, max(t - self.verify_s(d, rows), 0.0)))
        if len(pts) >= 2:
            n = len(pts)
            mx = sum(d for d, _ in pts) / n
            my = sum(v for _, v in pts) / n
            var = sum((d - mx) ** 2 for d, _ in pts)
            slope = sum((d - mx) * (v - my) for d, v in pts) / var if var else 0.0
            return max(my + max(slope, 0.0) * (depth - mx), 0.0)
        d1, v1 = pts[0]
        return v1 * depth / d1

    def seconds(self, depth: int, rows: int) -> float:
        """``T(depth)`` of a step of ``rows`` rows: the target part plus the draft part."""
        return self.verify_s(depth, rows) + self.draft_s(depth, rows)

    # ------------------------------------------------------------------ the decision
    def rates(self, limit: int | None = None, z: float = 0.0) -> list[float]:
        """Expected committed tokens per second of a step at each depth ``0..max`` over
        the live rows (``limit``: the most levels it may draft; ``z``: with optimistic
        acceptance, :meth:`optimism`)."""
        top = self.max_depth if limit is None else max(min(self.max_depth, limit), 0)
        keys = list(self._rows) or [None]
        lag = self.laggards()
        up = self.optimism(z) if z > 0.0 else ()
        priors = self._priors(top)  # shared by every row
        per_row = [self.expected_all(top, k, up, priors) for k in (lag or keys)]
        if lag:  # nobody waits: the slowest row's progress, scaled to the batch's tokens
            return [min(e[d] for e in per_row) * len(keys)
                    / max(self.seconds(d, len(keys)), 1e-12) for d in range(top + 1)]
        return [sum(e[d] for e in per_row) / max(self.seconds(d, len(keys)), 1e-12)
                for d in range(top + 1)]

    def laggards(self) -> list[int]:
        """The rows that finish the batch when none wait to join (:attr:`backlog` false):
        those with the most tokens left (within 10%); [] while sequences wait, or for
        fewer than two rows (one row's rate is the batch's)."""
        if self.backlog or len(self._rows) < 2:
            return []
        left = {k: self._left[k] for k in self._rows if k in self._left}
        if len(left) < 2:
            return []
        most = max(left.values())
        return [k for k, v in left.items() if v >= 0.9 * most]

    def decide(self) -> int:
        """The step's depth (0: plain decoding): the best rate (in the first
        :attr:`warmup` steps, drafting at once: every row where the prior says it pays,
        one row as a probe where it does not but could with optimistic acceptance,
        :meth:`explore`), a plain step to measure ``r0`` at this batch size, or a
        probe."""
        rates = self.rates()
        best = max(range(len(rates)), key=rates.__getitem__)
        rows = max(len(self._rows), 1)
        at = batch_key(rows)
        self._probing, self._probers = False, None
        warm = len(self.decisions) < self.warmup  # the warm-up drafts at once
        if warm and best == 0:  # the prior says plain: it looks where optimism says, as
            best = self.explore()  # a probe
            self._probing = best > 0
        if (best > 0 and not warm and self._r0_samples(at) < self.plain_probes
                and self._plain_probes.get(at, 0) < self.plain_tries
                and self._r0_decides(rows)):
            best = 0  # drafting wins against an r0 not measured at this batch size: measure
            self._plain_probes[at] = self._plain_probes.get(at, 0) + 1
        elif not warm:
            best = self._look(best)
        self._catching_up = False  # set by the first row that catches up (RowBudget.choose)
        self.decisions.append(best)
        if len(self.decisions) > 4096:  # a long-lived replica: keep the recent ones
            del self.decisions[:2048]
        self._timed = False
        return best

    def _r0_samples(self, at: int) -> int:
        """How many plain steps ``r0`` at batch size ``at`` rests on (a resumed value
        counts as one)."""
        recent = self._recent.get(("plain_ratios", at))
        if recent is not None:
            return len(recent)
        return 1 if at in self.plain_ratios else 0

    def _r0_decides(self, rows: int) -> bool:
        """Whether plain decoding would win at ``rows`` rows (where ``r0`` rests on fewer
        than :attr:`plain_probes` plain steps) with ``r0`` at :attr:`r0_doubt` times the
        estimate in use: a lower ``r0`` makes the target part cheaper against the draft
        part, so plain decoding gains. Where drafting wins even then, no plain step is
        spent measuring ``r0``: on ``reference-large`` the rows left as a batch ended
        (2-7) took up to 3 plain steps per row count where the estimates put drafting
        1.2-1.8x ahead, and most of those steps ran on a changed batch, so they measured
        nothing. Where no batch size within a factor of 2 of ``rows`` is measured, the
        estimate in use is a guess, and the answer is yes."""
        at = batch_key(rows)
        if self.r0_doubt <= 0.0 or not any(0.5 <= r / at <= 2.0 for r in self.plain_ratios):
            return True
        had = self.plain_ratios.get(at)
        self.plain_ratios[at] = self.ratio(rows) * self.r0_doubt
        try:
            rates = self.rates()
        finally:
            if had is None:
                del self.plain_ratios[at]
            else:
                self.plain_ratios[at] = had
        return rates[0] >= max(rates[1:])

    def _look(self, best: int) -> int:
        """The model chose ``best``: after :attr:`probe_every` decisions in a row of the
        same choice (doubling, up to 8x, while probes leave it unchanged; the first
        interval again once the model's choice changes), a probe at :meth:`explore`'s
        depth where that differs (the acceptance of positions no step drafted is only
        the prior's guess: a chain that drafted 1 level in every step never measured
        levels 2-4)."""
        if best != self._choice:  # the model changed its mind: the first interval again
            self._choice, self._run, self._probe_gap = best, 0, self.probe_every
        self._run += 1
        gap = self._probe_gap or self.probe_every
        if self._run < gap:
            return best
        self._run = 0
        look = self.explore()
        if look <= 0 or look == best:  # optimism agrees with the model: nothing to learn
            return best
        self._probe_gap = min(2 * gap, 8 * self.probe_every)
        self._probing = True
        return look

    def explore(self) -> int:
        """The depth a probe or a warm-up step drafts: the one that wins most with every
        position's acceptance raised by :meth:`optimism` (``probe_z``; with ``probe_z =
        0``, the best positive depth of the estimates), or 0 where even then plain
        decoding wins (such a probe could not change a decision). The optimistic best
        measures the deeper positions the estimates only guess: through Serve, a chain
        whose requests started from the default prior (0.5) learned depth 1 alone in its
        warm-up, found it did not pay, and drafted 1% of its rounds where gamma=4 (tau
        3.1) ran 1.18x plain decoding."""
        if self.probe_z <= 0.0:
            rates = self.rates()
            return max(range(1, len(rates)), key=rates.__getitem__)
        hope = self.rates(z=self.probe_z)
        best = max(range(1, len(hope)), key=hope.__getitem__)
        return best if hope[best] > hope[0] else 0

    def next_step(self) -> None:
        """A driver's batch step ended: the rows' next rounds get a new decision (the
        first row to ask makes it, the others share it)."""
        self.driven = True
        self._dirty = self._churned == self._step  # rows joined or left before it ran
        self._step += 1

    def changed(self) -> None:
        """The driver's step now running changes the batch (it prefills joining rows):
        like rows joining or leaving (:meth:`row`, :meth:`end`), its time teaches nothing.
        A Serve replica takes a request's row when the request arrives, while its prompt's
        prefill runs in a later step: that step, unmarked, taught plain steps of 2 and 4
        rows at 4.6x and 2.9x their curve while 16 clients' requests came in."""
        self._churned = self._step

    def current(self) -> int:
        """The decision in force: a new one per step of a driver (:meth:`next_step`),
        else once a round ended since the last."""
        stale = self._step != self._decided_at if self.driven else self._observed
        if self._decision is None or stale:
            self._decision = self.decide()
            self._decided_at, self._observed = self._step, False
        return self._decision

    def drafts(self, key: int) -> bool:
        """Whether row ``key`` drafts at the decision in force (asked in the step's row
        order): every row, but in a probe only the rows that drafted before (their
        draft holds their context: the probe costs them a catch-up over the plain run)
        or, when no live row did, the first to ask. A probe of every row cost each one
        its draft model's prefill: two probes of 8 SmolLM2 rows took 0.26-0.37 s of draft
        prefill, 3-4% of a 48-token run at batch 8; one row's, a few milliseconds. The
        step costs what a drafted step costs either way (every row's verification is
        padded to the longest row's tokens), and teaches the probed rows' acceptance."""
        if not self._probing:
            return True
        if self._probers is None:
            # a row that drafted a round has judged its first position
            self._probers = {k for k, a in self._rows.items() if a.judged[0] > 0} or {key}
        return key in self._probers

    def observe(self, key: int, budget: int, accepted: int, drafted: int,
                seconds: float) -> None:
        """Row ``key``'s round ended: its ``budget`` (levels it could draft; 0: plain),
        draft tokens ``accepted`` and ``drafted``, and its wall ``seconds`` (the step's).
        Every position up to the budget counts as judged (a drafter that proposed fewer
        tokens, or none, lost them), so ``E(d)`` is what a budget of ``d`` commits. The
        step's time counts once per decision (the first row to report it)."""
        acc = self._rows.get(key)
        if acc is not None and budget > 0:
            for k in range(1, self.max_depth + 1):
                acc.judged[k - 1] *= self.decay
                acc.hits[k - 1] *= self.decay
                if k <= budget and accepted >= k - 1:
                    acc.judged[k - 1] += 1.0
                    acc.hits[k - 1] += float(accepted >= k)
            self.width += 0.2 * (drafted / budget - self.width)
            old = self.nodes.get(budget)
            self.nodes[budget] = drafted if old is None else old + 0.2 * (drafted - old)
        if (not self._timed and (budget == self._decision or self._decision is None)
                and not self._dirty):
            self._timed = True
            rows = max(len(self._rows), 1)
            if budget <= 0:
                r = seconds / max(self.curve("target", rows, 1), 1e-12)
                self._learn("plain_ratios", batch_key(rows), r)
            elif not self._catching_up:  # (see _catching_up)
                r = seconds / max(self.curve("target", rows, 1 + round(drafted)), 1e-12)
                self._learn("step_ratios", (batch_key(rows), budget), r)
        self._observed = True

    def _learn(self, name: str, key: int | tuple[int, int], value: float) -> None:
        """``self.<name>[key]`` (``plain_ratios`` or ``step_ratios``) becomes the median of
        its last :attr:`window` values, ``value`` the newest (a value resumed from another
        budget, :meth:`resume`, counts as one)."""
        table = getattr(self, name)
        recent = self._recent.get((name, key))
        if recent is None:
            recent = self._recent[(name, key)] = deque(maxlen=self.window)
            if key in table:
                recent.append(table[key])
        recent.append(value)
        table[key] = statistics.median(recent)

    def state(self) -> dict:
        """What this budget learned: its time model and the acceptance of the rows that
        ended. A later budget of the same method and batch resumes from it
        (:meth:`resume`): a short generate then starts where the last one stopped."""
        ended = self._ended
        return {"plain_ratio": self.plain_ratio, "plain_ratios": dict(self.plain_ratios),
                "step_ratios": [[r, d, v] for (r, d), v in self.step_ratios.items()],
                "nodes": dict(self.nodes), "width": self.width,
                "ended": None if ended is None else [list(ended.judged), list(ended.hits)]}

    def resume(self, state: dict) -> AutoBudget:
        """Start from another budget's :meth:`state` (no warm-up: it measured already)."""
        self.plain_ratio, self.width = state["plain_ratio"], state["width"]
        self.plain_ratios = {int(r): v for r, v in state.get("plain_ratios", {}).items()}
        self.step_ratios = {(int(r), int(d)): v for r, d, v in state["step_ratios"]}
        self.nodes = dict(state["nodes"])
        self._recent.clear()  # each resumed value starts its window
        if state.get("ended") is not None and len(state["ended"][0]) == self.max_depth:
            self._ended = Acceptance(*(list(v) for v in state["ended"]))
        self.warmup = 0
        return self

    def end(self, key: int) -> None:
        """Row ``key`` left: its counts join those of the rows that ended (the prior of
        the rows to come) and no longer count in the decisions."""
        self._left.pop(key, None)
        acc = self._rows.pop(key, None)
        if acc is None:
            return
        self._churned = self._step
        if self._ended is None:
            self._ended = Acceptance([0.0] * self.max_depth, [0.0] * self.max_depth)
        for k in range(self.max_depth):  # decayed: the last requests weigh most
            self._ended.judged[k] = self.decay * self._ended.judged[k] + acc.judged[k]
            self._ended.hits[k] = self.decay * self._ended.hits[k] + acc.hits[k]


@dataclass
class RowBudget:
    """One sequence's view of an :class:`AutoBudget`: what the loop calls."""

    shared: AutoBudget
    key: int
    chosen: list[int] = field(default_factory=list)  # this sequence's budgets

    @property
    def max_depth(self) -> int:
        return self.shared.max_depth

    def choose(self, limit: int | None = None) -> int:
        """The round's budget in levels (0: plain decoding), at most ``limit`` (the
        tokens this sequence may still draft: the laggards' measure)."""
        if limit is not None:
            self.shared._left[self.key] = limit
        b = self.shared.current()
        if b > 0 and not self.shared.drafts(self.key):
            b = 0
        if limit is not None:
            b = max(min(b, limit), 0)
        if b > 0 and (not self.chosen or self.chosen[-1] == 0):
            self.shared._catching_up = True  # this row catches up: the step's time is not
        self.chosen.append(b)               # a steady drafted step's
        return b

    def observe(self, budget: int, accepted: int, drafted: int, seconds: float) -> None:
        """The round ended (see :meth:`AutoBudget.observe`)."""
        self.shared.observe(self.key, budget, accepted, drafted, seconds)

    def q(self, k: int) -> float:
        """This sequence's estimated acceptance at position ``k``."""
        return self.shared.q(k, self.key)

    def close(self) -> None:
        """The sequence ended."""
        self.shared.end(self.key)


def _nearest(keys, key: int) -> int:
    """The measured batch size in ``keys`` nearest ``key`` in log rows (ties: the
    smaller)."""
    return min(keys, key=lambda r: (abs(math.log(r / max(key, 1))), r))

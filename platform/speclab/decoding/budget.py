"""The ``auto`` draft budget: before each round, the draft depth that maximises expected
committed tokens per second (0: plain decoding), from measured forward costs and the
request's running per-position acceptance.

One :class:`AutoBudget` per sequence (a row of the batched engine, a Serve request). The
loop (:func:`speclab.decoding.loop.rounds`) asks :meth:`AutoBudget.choose` for the
round's budget in levels (a chain's gamma, a tree's depth: the drafter drafts at most that
many levels, with its method's own width) and reports the round back with
:meth:`AutoBudget.observe`. The choice uses only past rounds, so it never changes what is
decoded: at temperature 0 the output is plain decoding's, and when sampling each round's
rule is exact for whatever budget it was given.

The model of a round of depth ``d`` at ``rows`` rows:

* expected committed tokens ``E(d) = 1 + sum_{k<=d} prod_{j<=k} q_j``, with ``q_j`` the
  conditional acceptance at draft position ``j`` (given ``j-1`` accepted), counted per
  sequence with a decay (recent rounds weigh more) on top of a prior (the drafter's
  measured acceptance, weight :attr:`AutoBudget.prior_weight` rounds);
* seconds ``T(d) = (target(rows, 1 + w d) + d draft(rows, w)) * ratio(d)``: the
  calibrated cost curves (:mod:`speclab.calibration`; ``draft`` only for a draft model,
  0 for model-free drafters), ``w`` the running number of draft nodes per level (1 for
  chains), and ``ratio(d)`` the running ratio of the rounds' wall time at depth ``d``
  (or the nearest depth measured) to those modelled forwards: what the curves do not
  see (a drafter's own network, tree building, the rule, Python) scales with them;
* ``T(0) = target(rows, 1) * ratio(0)``, ``E(0) = 1``.

``choose`` returns ``argmax_d E(d) / T(d)``. A sequence that chose 0 for
:attr:`AutoBudget.probe_every` rounds in a row drafts once at the best positive depth, so
its acceptance estimate stays current. Pure Python: no Ray, no MLflow, no tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

#: (rows, new tokens) -> seconds of one forward
Cost = Callable[[int, int], float]


@dataclass
class RoundCosts:
    """What a round's forwards cost: the target's curve and, when the drafter runs a
    model with a calibrated curve, that model's (per level: ``draft(rows, nodes)``)."""

    target: Cost
    draft: Cost | None = None


@dataclass
class AutoBudget:
    """One sequence's budget controller (see the module docstring).

    ``max_depth``: the method's own draft length (``MethodSpec.draft_length()``);
    ``prior``: conditional acceptance per position ``q_1..q_n`` (shorter: its last value
    repeats; empty: 0.5); ``rows``: the current batch size (a callable: the batched
    engine and Serve change it as rows come and go)."""

    costs: RoundCosts
    max_depth: int
    prior: Sequence[float] = ()
    rows: Callable[[], int] = lambda: 1
    prior_weight: float = 4.0
    decay: float = 0.97
    probe_every: int = 16
    #: per position k (index k-1): decayed counts of rounds that judged / accepted it
    judged: list[float] = field(default_factory=list)
    hits: list[float] = field(default_factory=list)
    width: float = 1.0  # draft nodes per level
    #: per depth: running ratio of the rounds' wall seconds to the modelled forwards
    ratio: dict[int, float] = field(default_factory=dict)
    #: per depth: running number of draft tokens a round of that budget proposed
    nodes: dict[int, float] = field(default_factory=dict)
    #: the first rounds draft at the method's own length (measuring it)
    warmup: int = 2
    chosen: list[int] = field(default_factory=list)  # every round's budget
    _plain_run: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.max_depth, bool) or self.max_depth < 1:
            raise ValueError(f"budget: auto needs a method with a draft length >= 1, got "
                             f"{self.max_depth}")
        self.judged = [0.0] * self.max_depth
        self.hits = [0.0] * self.max_depth

    def q(self, k: int) -> float:
        """Estimated acceptance at position ``k`` (1-based) given ``k - 1`` accepted."""
        prior = self.prior[min(k, len(self.prior)) - 1] if self.prior else 0.5
        w = self.prior_weight
        return (self.hits[k - 1] + w * prior) / (self.judged[k - 1] + w)

    def expected_tokens(self, depth: int) -> float:
        """``E(depth)``: expected tokens a round of that depth commits."""
        total, p = 1.0, 1.0
        for k in range(1, depth + 1):
            p *= self.q(k)
            total += p
        return total

    def modelled(self, depth: int, rows: int, nodes: float | None = None) -> float:
        """Seconds of a round's forwards at ``depth`` on the calibrated curves: the
        target over the root and ``nodes`` draft tokens (default: ``width * depth``) and
        ``depth`` forwards of the draft model (when it has a curve)."""
        if depth == 0:
            return self.costs.target(rows, 1)
        if nodes is None:
            nodes = self.nodes.get(depth, self.width * depth)
        n = round(nodes)
        level = 0.0 if self.costs.draft is None else \
            self.costs.draft(rows, max(round(self.width), 1))
        return self.costs.target(rows, 1 + n) + depth * level

    def seconds(self, depth: int, rows: int) -> float:
        """``T(depth)`` at ``rows`` rows: the modelled forwards times the running ratio
        of wall to modelled time measured at that depth (or the nearest measured one;
        1 before any)."""
        if not self.ratio:
            r = 1.0
        elif depth in self.ratio:
            r = self.ratio[depth]
        else:
            near = min(self.ratio, key=lambda d: (abs(d - depth), d == 0))
            r = self.ratio[near]
        return self.modelled(depth, rows) * r

    def rates(self, limit: int | None = None) -> list[float]:
        """Expected committed tokens per second for each depth ``0..max`` (``limit``: the
        most levels this round may draft)."""
        top = self.max_depth if limit is None else max(min(self.max_depth, limit), 0)
        rows = max(int(self.rows()), 1)
        return [self.expected_tokens(d) / max(self.seconds(d, rows), 1e-12)
                for d in range(top + 1)]

    def choose(self, limit: int | None = None) -> int:
        """The round's budget in levels (0: plain decoding), at most ``limit``."""
        rates = self.rates(limit)
        best = max(range(len(rates)), key=rates.__getitem__)
        if len(self.chosen) < self.warmup:
            best = len(rates) - 1
        if best == 0 and len(rates) > 1:
            self._plain_run += 1
            if self._plain_run >= self.probe_every:
                best = max(range(1, len(rates)), key=rates.__getitem__)
        if best > 0:
            self._plain_run = 0
        self.chosen.append(best)
        return best

    def observe(self, budget: int, accepted: int, drafted: int, seconds: float) -> None:
        """A round ended: its ``budget`` (levels it could draft; 0: plain), draft tokens
        ``accepted`` and ``drafted``, and its wall ``seconds``. Every position up to the
        budget counts as judged (a drafter that proposed fewer tokens, or none, lost
        them), so ``E(d)`` is what a budget of ``d`` commits with this drafter."""
        rows = max(int(self.rows()), 1)
        if budget > 0:
            for k in range(1, self.max_depth + 1):
                self.judged[k - 1] *= self.decay
                self.hits[k - 1] *= self.decay
                if k <= budget and accepted >= k - 1:
                    self.judged[k - 1] += 1.0
                    self.hits[k - 1] += float(accepted >= k)
            self.width += 0.2 * (drafted / budget - self.width)
            old = self.nodes.get(budget)
            self.nodes[budget] = drafted if old is None else old + 0.2 * (drafted - old)
        r = seconds / max(self.modelled(budget, rows, drafted if budget else None), 1e-12)
        old = self.ratio.get(budget)
        self.ratio[budget] = r if old is None else old + 0.2 * (r - old)


def conditional_acceptance(at_least: Sequence[float]) -> list[float]:
    """Per-position conditional acceptance ``q_k = P(>= k) / P(>= k-1)`` from the
    fractions of rounds that accepted at least ``k`` drafts
    (:func:`speclab.decoding.loop.accept_at_least`); NaN or missing positions end it."""
    out, prev = [], 1.0
    for a in at_least:
        if a != a or prev <= 0:  # NaN: no round reached it
            break
        out.append(min(max(a / prev, 0.0), 1.0))
        prev = a
    return out

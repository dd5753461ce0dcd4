"""How a wall-clock speedup is read off paired timings (pure Python: no torch, no Ray).

Wall clock on a shared machine is noisy: another process taking the CPU for a few
seconds slows whatever runs then. Timing a whole block of plain (AR) decoding and then a
whole block of a method, and dividing, lets one slowed block move a speedup 2-3x. The
protocol (:func:`speclab.evaluation.interleaved_comparison`) therefore times each method
in PAIRS with plain decoding, adjacent in time: per prompt (or, batched, per pass over
the whole batch), AR then the method, over repeated passes (AR first in even passes,
the method first in odd ones, so neither side always runs warm). A slowdown lasting
longer than a pair slows both halves, and their ratio barely moves.

Figures of one method, from its pairs ``k`` (method tokens ``n_k`` in ``s_k`` seconds,
AR tokens ``a_k`` in ``t_k`` seconds):

* paired ratio ``r_k = (n_k / s_k) / (a_k / t_k)`` (tokens/s over AR's tokens/s);
* ``speedup``: the median of the ``r_k``;
* ``speedup_lo`` / ``speedup_hi``: a distribution-free 95% interval for that median from
  order statistics: ``[r_(l), r_(n+1-l)]`` of the sorted ratios, with the largest ``l``
  whose coverage ``1 - 2 P(Binomial(n, 1/2) <= l - 1)`` is at least 95% (no assumption
  about the noise's distribution; exact for independent pairs). Chosen over a bootstrap
  because it needs no random numbers and no resampling, and its coverage is known
  exactly: ``speedup_coverage``. With fewer than 6 pairs no interval reaches 95%: it is
  then the range of the pairs and ``speedup_coverage`` says how much it covers (3 pairs:
  75%). Pairs of the same prompt in different passes are balanced strata of the prompt
  set (every prompt the same number of times), which only narrows the median's spread,
  so the interval stays conservative;
* ``speedup_totals``: the ratio of totals, ``(sum n / sum s) / (sum a / sum t)``, i.e.
  the row's ``tokens_per_s`` over its ``ar_tokens_per_s``;
* ``ar_spread``: how much the method's AR timings moved: each AR timing over the median
  of all AR timings of the same prompt (every method's, every pass: the same work each
  time), and the spread is the distance between the 10th and 90th percentiles of those
  ratios (0.1: the middle 80% of AR timings lie within 10% of each other);
* ``noisy``: ``ar_spread`` above :data:`AR_SPREAD_BOUND`, or ``speedup_totals`` outside
  ``[speedup_lo, speedup_hi]``; ``timing_note`` says which. So the ``speedup`` and
  ``tokens_per_s`` columns never contradict each other beyond the interval unless the
  row says so. (Without noise the two can still differ: the ratio of totals weighs
  each pair by its seconds, the median does not; prompts with very different speedups
  can put the ratio of totals outside the median's interval, and the flag says so.)

The engine's own share of the wall time (:mod:`speclab.forward_costs` prices each
block's forwards on measured cost curves: the block's ``modelled_s``) is read off the
same pairs: per block ``o_k = (s_k - modelled_k) / s_k``; ``engine_overhead`` is the
median of the ``o_k`` with the same order-statistics interval (``engine_overhead_lo`` /
``engine_overhead_hi``), and ``engine_overhead_totals`` is ``(sum s - sum modelled) /
sum s``. The cost curves are medians of repeated forwards, so a sum of wall times that
includes a shared machine's stalls, set against them, counts every stall as the
engine's; the median over blocks leaves a stall to the blocks it touched.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

#: the interval's target coverage
CONFIDENCE = 0.95

#: timed passes of the protocol by default (``decoding.timing_passes``; bench, evaluate,
#: the sweeps and the engine figures logged during training)
TIMING_PASSES = 3

#: ``ar_spread`` above this flags a row ``noisy``: the middle 80% of its AR timings of
#: the same work spread over more than 25% of their median (a quiet CPU: about 5-10%)
AR_SPREAD_BOUND = 0.25


@dataclass(frozen=True)
class Pair:
    """One A/B pair: AR and the method on the same work, one right after the other.

    ``unit``: what both decoded (a prompt's index; ``-1``: the whole batch); ``ar_norm``:
    ``ar_s`` over the median AR time of the same unit across every pair of the
    comparison (NaN until :func:`normalize_ar` sets it). ``shapes`` / ``ar_shapes``:
    the forwards each side ran (``{(model id, rows, new tokens): count}``, empty when
    not recorded); ``modelled_s`` / ``ar_modelled_s``: their measured cost (NaN until
    priced)."""

    unit: int
    pass_index: int
    ar_s: float
    ar_tokens: int
    s: float
    tokens: int
    ar_norm: float = math.nan
    shapes: Counter = field(default_factory=Counter, compare=False, repr=False)
    ar_shapes: Counter = field(default_factory=Counter, compare=False, repr=False)
    modelled_s: float = math.nan
    ar_modelled_s: float = math.nan

    @property
    def ratio(self) -> float:
        """The method's tokens/s over AR's (NaN when either side has no tokens or time)."""
        if self.s <= 0 or self.ar_s <= 0 or self.tokens <= 0 or self.ar_tokens <= 0:
            return math.nan
        return (self.tokens / self.s) / (self.ar_tokens / self.ar_s)


def median(values: Iterable[float]) -> float:
    """The median (the mean of the two middle values for an even count); NaN if empty."""
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        return math.nan
    mid = n // 2
    return xs[mid] if n % 2 else (xs[mid - 1] + xs[mid]) / 2


def quantile(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile with linear interpolation between order statistics (NaN if
    empty)."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def binomial_cdf(k: int, n: int) -> float:
    """``P(Binomial(n, 1/2) <= k)``."""
    if k < 0:
        return 0.0
    return min(1.0, sum(math.comb(n, i) for i in range(min(k, n) + 1)) / 2**n)


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE
                    ) -> tuple[float, float, float]:
    """``(lo, hi, coverage)``: the distribution-free interval for the median of
    ``values`` from order statistics (see the module docstring). ``coverage`` is the
    interval's exact coverage for independent draws; below ``confidence`` only when
    there are too few values for any interval to reach it (then ``lo, hi`` is their
    range). ``(NaN, NaN, 0.0)`` for no values."""
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        return math.nan, math.nan, 0.0
    best = 1  # the order statistic's rank from each end (1: min and max)
    for rank in range(1, (n + 1) // 2 + 1):
        if 1 - 2 * binomial_cdf(rank - 1, n) >= confidence:
            best = rank
        else:
            break
    coverage = max(0.0, 1 - 2 * binomial_cdf(best - 1, n))
    return xs[best - 1], xs[n - best], coverage


def normalize_ar(pairs: Sequence[Pair]) -> list[Pair]:
    """``pairs`` with ``ar_norm`` set: each AR time over the median AR time of its unit
    among ``pairs`` (pass all pairs of a comparison: every method's)."""
    ref = _unit_medians((p.unit, p.ar_s) for p in pairs if p.ar_s > 0)
    out = []
    for p in pairs:
        r = ref.get(p.unit, math.nan)
        norm = p.ar_s / r if r and r > 0 and p.ar_s > 0 else math.nan
        out.append(replace(p, ar_norm=norm))
    return out


def ar_spread(pairs: Iterable[Pair]) -> float:
    """The 10th-90th percentile distance of the pairs' ``ar_norm`` (0.0 for one pair,
    NaN when none is normalised)."""
    xs = [p.ar_norm for p in pairs if not math.isnan(p.ar_norm)]
    if not xs:
        return math.nan
    return quantile(xs, 0.9) - quantile(xs, 0.1)


def totals_ratio(pairs: Iterable[Pair]) -> float:
    """``(sum tokens / sum s) / (sum ar_tokens / sum ar_s)`` over ``pairs`` (NaN if
    either side is empty)."""
    n = s = a = t = 0.0
    for p in pairs:
        n, s, a, t = n + p.tokens, s + p.s, a + p.ar_tokens, t + p.ar_s
    if s <= 0 or t <= 0 or a <= 0:
        return math.nan
    return (n / s) / (a / t)


def unit_speedups(pairs: Iterable[Pair], units: int) -> list[float]:
    """Each unit's own speedup: ``[s_0, ..., s_{units-1}]``, ``s_u`` the median paired
    ratio of the pairs of unit ``u`` (one per timed pass; NaN where unit ``u`` has none
    with a ratio). Units are prompt indexes in prompt order, so two methods' lists over
    the same prompts pair up prompt by prompt (:func:`speclab.orderings.paired_speedup`);
    batched pairs (unit ``-1``) belong to no prompt and are left out."""
    med = _unit_medians((p.unit, p.ratio) for p in pairs
                        if 0 <= p.unit < units and not math.isnan(p.ratio))
    return [med.get(u, math.nan) for u in range(units)]


def _unit_medians(values: Iterable[tuple[int, float]]) -> dict[int, float]:
    """``{unit: median of its values}`` over ``(unit, value)`` pairs."""
    by_unit: dict[int, list[float]] = {}
    for unit, value in values:
        by_unit.setdefault(unit, []).append(value)
    return {u: median(v) for u, v in by_unit.items()}


def speedup_figures(pairs: Sequence[Pair], speedup_totals: float | None = None,
                    bound: float = AR_SPREAD_BOUND) -> dict[str, float | int | bool | str]:
    """A method's wall-clock speedup figures from its ``pairs`` (see the module docstring):
    ``speedup``, ``speedup_lo``, ``speedup_hi``, ``speedup_coverage``, ``speedup_pairs``
    (pairs with a ratio), ``speedup_totals`` (given, e.g. the row's tokens/s over its AR
    tokens/s, or from the pairs), ``ar_spread``, ``noisy`` and ``timing_note`` (empty
    when not noisy, else the reasons)."""
    ratios = [r for r in (p.ratio for p in pairs) if not math.isnan(r)]
    lo, hi, coverage = median_interval(ratios)
    totals = totals_ratio(pairs) if speedup_totals is None else float(speedup_totals)
    spread = ar_spread(pairs)
    notes = []
    if not math.isnan(spread) and spread > bound:
        notes.append(f"AR timings spread {spread:.2f} > {bound:.2f}")
    if ratios and not math.isnan(totals) and not (
            lo * (1 - 1e-9) <= totals <= hi * (1 + 1e-9)):
        notes.append(f"ratio of totals {totals:.2f}x outside [{lo:.2f}, {hi:.2f}]")
    return {"speedup": median(ratios), "speedup_lo": lo, "speedup_hi": hi,
            "speedup_coverage": coverage, "speedup_pairs": len(ratios),
            "speedup_totals": totals, "ar_spread": spread, "noisy": bool(notes),
            "timing_note": "; ".join(notes)}


def baseline_figures(pairs: Sequence[Pair], bound: float = AR_SPREAD_BOUND
                     ) -> dict[str, float | int | bool | str]:
    """:func:`speedup_figures` of the AR row itself: speedup 1 with the degenerate
    interval ``[1, 1]`` (AR against itself, exactly), and the spread of ALL AR timings
    (``pairs``: every method's)."""
    spread = ar_spread(pairs)
    noisy = not math.isnan(spread) and spread > bound
    return {"speedup": 1.0, "speedup_lo": 1.0, "speedup_hi": 1.0, "speedup_coverage": 1.0,
            "speedup_pairs": len(pairs), "speedup_totals": 1.0, "ar_spread": spread,
            "noisy": noisy,
            "timing_note": f"AR timings spread {spread:.2f} > {bound:.2f}" if noisy else ""}


def overhead_figures(pairs: Sequence[Pair], ar_side: bool = False) -> dict[str, float]:
    """The engine's share of the wall time over ``pairs`` (see the module docstring): the
    method's blocks, or with ``ar_side`` their AR blocks. ``engine_overhead`` (the median
    of the per-block shares), ``engine_overhead_lo`` / ``engine_overhead_hi`` (its
    interval, :func:`median_interval`) and ``engine_overhead_totals`` (over the summed
    times); NaN where no block was priced."""
    walls, models = [], []
    for p in pairs:
        wall, model = (p.ar_s, p.ar_modelled_s) if ar_side else (p.s, p.modelled_s)
        if wall > 0 and not math.isnan(model):
            walls.append(wall)
            models.append(model)
    shares = [(w - m) / w for w, m in zip(walls, models)]
    lo, hi, _ = median_interval(shares)
    total = sum(walls)
    return {"engine_overhead": median(shares), "engine_overhead_lo": lo,
            "engine_overhead_hi": hi,
            "engine_overhead_totals": (total - sum(models)) / total if total else math.nan}

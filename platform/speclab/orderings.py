"""The papers' orderings of drafters, re-tested on paired prompts (pure Python: no torch,
no Ray, no MLflow).

An ordering claims that one drafter (``above``) accepts more than another (``below``)
under the same decoding method: HASS above EAGLE, TALF above EAGLE and HASS, EAGLE-3
above EAGLE-2, MEDUSA-2 above MEDUSA-1. Both drafters decode the SAME prompts, so each
prompt gives a paired ratio ``r_i = tau_above_i / tau_below_i`` (tau: tokens committed
per target call on that prompt). The ordering's figures:

* ``difference``: the median of the ``r_i`` minus 1 (``+0.058``: the drafter above
  accepts 5.8% more on the median prompt), with the distribution-free 95% interval of
  that median from order statistics (``difference_lo`` / ``difference_hi``; the same
  interval as the paired speedups, :func:`speclab.paired_timing.median_interval`: no
  assumption about the spread of the ratios, exact coverage ``coverage`` for
  independent prompts);
* ``tau_ratio``: the ratio of the two mean taus (every prompt weighed alike);
* ``verdict``: ``holds`` when the interval lies above 0, ``fails`` when it lies below,
  ``unresolved`` when it contains 0 (too few prompts, or no difference);
* ``speedup_above`` / ``speedup_below``: beside the tau ordering, each row's own median
  paired speedup over plain decoding, where the rows carry one (a claim made in speedup,
  as EAGLE-3's, can differ from the tau ordering: EAGLE-3's smaller draft vocabulary
  makes each draft step cheaper at equal tau), with the rows' own intervals
  (``speedup_lo`` / ``speedup_hi``);
* ``speedup_ratio``: where both rows carry each prompt's own speedup over plain
  decoding (``speedup_per_prompt``: the prompt's paired ratios, median over passes), the
  speedup ordering paired the same way as tau: the median over prompts of
  ``s_above_i / s_below_i`` with its order-statistics interval (``speedup_ratio_lo`` /
  ``speedup_ratio_hi``) and ``speedup_verdict`` (``holds`` / ``fails`` /
  ``unresolved`` as for tau). Each side's speedup was paired with its own plain decoding
  of the prompt, so timing noise of either side's pair widens the interval rather than
  hiding in it. A shift of the machine's speed between two separately timed evaluations
  (``train_medusa``'s variants, each evaluated against its own target) moves every
  prompt's ratio alike and is not in the interval: read such a ratio beside the tau
  difference.

A prompt whose tau is missing on either side (NaN) is left out of both; a comparison
whose prompt counts differ is refused (the two rows did not decode the same prompts).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from speclab.paired_timing import median, median_interval


@dataclass(frozen=True)
class Ordering:
    """A published claim: drafter row ``above`` accepts more than row ``below``."""

    above: str
    below: str
    claim: str  # what the paper reports, for the table


#: the orderings issue 55 re-tests, by the comparison rows' names (``compare.losses`` of
#: ``compare_eagle``; ``medusa.variants`` of ``train_medusa``, whose table keys them by
#: ``variant``)
PAPER_ORDERINGS: tuple[Ordering, ...] = (
    Ordering("hass", "eagle", "HASS paper: +8-20% tau over EAGLE"),
    Ordering("talf", "eagle", "TALF paper: +3.5-7% tau over EAGLE"),
    Ordering("talf", "hass", "TALF paper: above HASS"),
    Ordering("eagle3", "eagle", "EAGLE-3 paper: ~1.4x EAGLE-2's speedup"),
    Ordering("eagle3_talf", "eagle3", "TALF paper: TALF on EAGLE-3 above EAGLE-3"),
    Ordering("medusa2", "medusa1", "Medusa paper: MEDUSA-2 above MEDUSA-1"),
)


def _pairs(below: Sequence[float], above: Sequence[float], what: str
           ) -> list[tuple[float, float]]:
    """The prompts' ``(below_i, above_i)`` with both figures present (not NaN) and
    ``below_i > 0``; ValueError naming ``what`` when the lengths differ."""
    if len(below) != len(above):
        raise ValueError(f"{what}: {len(below)} prompts against {len(above)}; "
                         "an ordering compares two rows over the same prompts")
    return [(b, a) for b, a in zip(below, above, strict=True)
            if not (math.isnan(b) or math.isnan(a)) and b > 0]


def _verdict(lo: float, hi: float) -> str:
    return "holds" if lo > 1 else "fails" if hi < 1 else "unresolved"


def paired_speedup(below: Sequence[float], above: Sequence[float]) -> dict[str, float | str]:
    """The speedup ordering from per-prompt speedups over plain decoding of the same
    prompts (``below[i]`` / ``above[i]``: prompt ``i``'s median paired speedup under each
    row): ``speedup_ratio`` (the median of ``above_i / below_i``), its interval
    ``speedup_ratio_lo`` / ``speedup_ratio_hi`` and ``speedup_verdict`` (module
    docstring); NaN and ``unresolved`` without pairs. Raises ``ValueError`` when the
    lengths differ."""
    ratios = [a / b for b, a in _pairs(below, above, "paired_speedup")]
    if not ratios:
        return {"speedup_ratio": math.nan, "speedup_ratio_lo": math.nan,
                "speedup_ratio_hi": math.nan, "speedup_verdict": "unresolved"}
    lo, hi, _ = median_interval(ratios)
    return {"speedup_ratio": median(ratios), "speedup_ratio_lo": lo, "speedup_ratio_hi": hi,
            "speedup_verdict": _verdict(lo, hi)}


def paired_difference(below: Sequence[float], above: Sequence[float]) -> dict[str, float]:
    """Figures of ``above`` against ``below`` from per-prompt taus of the same prompts
    (``below[i]`` and ``above[i]``: prompt ``i``'s tau under each; lengths equal):
    ``difference`` (median paired ratio - 1) with ``difference_lo`` / ``difference_hi``
    and their ``coverage``, ``tau_ratio`` (ratio of means), ``prompts`` (pairs used) and
    ``verdict`` (module docstring). Raises ``ValueError`` when the lengths differ."""
    pairs = _pairs(below, above, "paired_difference")
    if not pairs:
        return {"difference": math.nan, "difference_lo": math.nan,
                "difference_hi": math.nan, "coverage": 0.0, "tau_ratio": math.nan,
                "prompts": 0, "verdict": "unresolved"}
    ratios = [a / b for b, a in pairs]
    lo, hi, coverage = median_interval(ratios)
    mean_below = sum(b for b, _ in pairs) / len(pairs)
    mean_above = sum(a for _, a in pairs) / len(pairs)
    return {"difference": median(ratios) - 1, "difference_lo": lo - 1,
            "difference_hi": hi - 1, "coverage": coverage,
            "tau_ratio": mean_above / mean_below, "prompts": len(pairs),
            "verdict": _verdict(lo, hi)}


def ordering_rows(table: Sequence[dict], key: str = "loss",
                  orderings: Sequence[Ordering] = PAPER_ORDERINGS) -> list[dict]:
    """One row per ordering and method whose two drafters are both in ``table`` (rows
    with ``key`` naming the drafter, ``method``, ``tau`` and ``tau_per_prompt``: the
    comparison table of :func:`speclab.pipelines.comparison.comparison_rows`): the
    ordering's ``above`` / ``below`` / ``claim``, the method, both mean taus and
    :func:`paired_difference`'s figures. Orderings with a side missing are skipped."""
    methods = list(dict.fromkeys(r["method"] for r in table))
    return [{"above": row["above"], "below": row["below"], "method": m, **row}
            for o in orderings for m in methods
            for row in paired_rows([r for r in table if r["method"] == m], [o], key)]


def paired_rows(rows: Sequence[dict], orderings: Sequence[Ordering],
                key: str = "method") -> list[dict]:
    """One row per ordering whose two rows are both in ``rows`` (found by ``key``: the
    evaluate table's ``method`` column, i.e. each method's label; each row with ``tau``
    and ``tau_per_prompt``): ``above`` / ``below`` / ``claim``, both mean taus
    (``tau_above`` / ``tau_below``) and :func:`paired_difference`'s figures. Orderings
    with a side missing are skipped."""
    cells = {r[key]: r for r in rows if "tau_per_prompt" in r}
    out = []
    for o in orderings:
        lo_row, hi_row = cells.get(o.below), cells.get(o.above)
        if lo_row is None or hi_row is None:
            continue
        out.append({"above": o.above, "below": o.below, "tau_above": hi_row["tau"],
                    "tau_below": lo_row["tau"],
                    **paired_difference(lo_row["tau_per_prompt"], hi_row["tau_per_prompt"]),
                    **_speedups(hi_row, lo_row), "claim": o.claim})
    return out


def _speedups(above: dict, below: dict) -> dict[str, float | str]:
    """``speedup_above`` / ``speedup_below`` (and their ``_lo`` / ``_hi``) from the two
    rows' speedup figures, for whichever the rows both carry, and
    :func:`paired_speedup`'s figures where both carry ``speedup_per_prompt`` (module
    docstring)."""
    out: dict[str, float | str] = {}
    for name in ("speedup", "speedup_lo", "speedup_hi"):
        if name in above and name in below:
            out[f"{name}_above"], out[f"{name}_below"] = above[name], below[name]
    if "speedup_per_prompt" in above and "speedup_per_prompt" in below:
        out.update(paired_speedup(below["speedup_per_prompt"], above["speedup_per_prompt"]))
    return out


def speedups_cell(row: dict) -> str:
    """``0.44x / 0.33x``: the rows' own median speedups, above / below, and where the
    rows carried per-prompt speedups their paired ratio, ``0.44x / 0.33x = 1.31x [1.18,
    1.45] holds``; ``-`` when the rows carried none."""
    if "speedup_above" not in row:
        return "-"
    cell = f"{row['speedup_above']:.2f}x / {row['speedup_below']:.2f}x"
    r = row.get("speedup_ratio")
    if r is None or math.isnan(r):
        return cell
    return (f"{cell} = {r:.2f}x [{row['speedup_ratio_lo']:.2f}, "
            f"{row['speedup_ratio_hi']:.2f}] {row['speedup_verdict']}")


def difference_cell(row: dict) -> str:
    """``+5.8% [+2.9, +9.2]``: the median paired difference and its interval, in
    percent; ``-`` when there were no pairs."""
    d, lo, hi = row.get("difference"), row.get("difference_lo"), row.get("difference_hi")
    if d is None or math.isnan(d):
        return "-"
    return f"{d * 100:+.1f}% [{lo * 100:+.1f}, {hi * 100:+.1f}]"

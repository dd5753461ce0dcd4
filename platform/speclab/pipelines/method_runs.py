"""Stage: one MLflow child run per evaluated method (or per point of a grid) under the
job's run, with the method's settings as ``method.*`` params and the SAME metric keys
in every child, so MLflow's run comparison, parallel-coordinates and chart views put
methods side by side (the layout of a sweep's trials).

The parent keeps the summary table, the config, the plots and ``best_*`` metrics.
Wall-clock metrics follow the paired timing protocol (:mod:`speclab.paired_timing`):
every child has ``speedup`` (median paired ratio), ``speedup_lo`` / ``speedup_hi`` (its
95% interval), ``speedup_totals``, ``ar_spread``, ``noisy`` (0/1), ``modelled_s`` and
``engine_overhead``; NaN where a figure does not apply (no forward costs measured, a
Hugging Face baseline's overhead).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from speclab.evaluation import ACCEPT_POSITIONS, auto_label, distinct_knobs


def uniform_metrics(rows: list[dict], skip: Iterable[str] = ()) -> list[dict[str, float]]:
    """The numeric columns of ``rows`` as metrics with one key set for every row: the
    union of the columns holding a number (or bool, as 0/1) or None in any row; a row
    missing one, or holding None there, gets NaN (a figure that does not apply, e.g. a
    spread of batched wall times, stays a column). Columns in ``skip`` are left out."""
    skip = set(skip)

    def numeric(v: Any) -> bool:
        return isinstance(v, (int, float))  # bool is an int: logged as 0/1

    keys = list(dict.fromkeys(k for r in rows for k, v in r.items()
                              if k not in skip and (v is None or numeric(v))))
    out = []
    for r in rows:
        vals = {}
        for k in keys:
            v = r.get(k)
            vals[k] = float(v) if numeric(v) else math.nan
        out.append(vals)
    return out


def child_run_name(tracker, label: str) -> str:
    """``label`` under a job's top-level run (the UI nests it under its parent); under a
    run that is itself a child (a loss of ``compare_losses``, a Medusa variant),
    ``<that run's name>/<label>``, so the methods of different losses stay apart when
    compared side by side."""
    parent = getattr(tracker, "run_name", None)
    return f"{parent}/{label}" if parent and getattr(tracker, "nested", False) else label


def log_child_runs(tracker, rows: list[dict], params: list[dict], tags: dict | None = None,
                   skip: Iterable[str] = ()) -> None:
    """One child run of ``tracker``'s run per row: ``params[i]`` logged as
    ``method.<key>`` params, every numeric column of the rows as a metric under the
    same keys in every child (:func:`uniform_metrics`), ``tags`` beside ``kind``,
    ``method`` (the full label) and a colour of its own (:data:`RUN_COLORS`); a row's
    ``decode_s`` becomes the run's duration (its decoding time). The run is named by
    :func:`short_run_names` (see :func:`child_run_name`), short enough for the UI's run
    column. Rows with ``accept_at_k`` columns also get the metric ``acceptance_at_least``
    at step ``k`` (one line per method in MLflow's charts)."""
    if len(rows) != len(params):
        raise ValueError(f"{len(rows)} rows but {len(params)} parameter sets")
    names = short_run_names(params, [str(r.get("method")) for r in rows])
    for i, (row, p, metrics, short) in enumerate(zip(rows, params, uniform_metrics(rows, skip),
                                                     names)):
        label = str(p.get("label") or p.get("name") or row.get("method"))
        with tracker.child(child_run_name(tracker, short), {"method": p}) as child:
            child.set_tags({"kind": "method", "method": label,
                            RUN_COLOR: RUN_COLORS[i % len(RUN_COLORS)], **(tags or {})})
            child.log_metrics({**metrics, **summary_metrics(metrics)})
            steps = {k: metrics[f"accept_at_{k}"] for k in range(1, ACCEPT_POSITIONS + 1)
                     if f"accept_at_{k}" in metrics}
            if steps:
                child.log_series("acceptance_at_least", steps)
        if isinstance(row.get("decode_s"), int | float) and row["decode_s"] > 0:
            child.set_duration(row["decode_s"])  # the Duration column: its decoding time


#: the tag the MLflow UI reads a run's colour from (charts, runs table)
RUN_COLOR = "mlflow.runColor"
#: one colour per method run, in order (matplotlib's tab20, the strong ones first): no
#: two of up to 20 methods share a colour in the chart view
RUN_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
              "#7f7f7f", "#bcbd22", "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896",
              "#c5b0d5", "#c49c94", "#f7b6d2", "#c7c7c7", "#dbdb8d", "#9edae5")


#: the figures that answer "which method, how much faster": also logged under
#: ``summary/`` (MLflow's chart view groups metrics by prefix, so these lead)
HEADLINE = ("tau", "speedup", "speedup_lo", "speedup_hi", "target_calls_per_token",
            "tokens_per_s", "acceptance_rate")


def summary_metrics(metrics: dict[str, float], prefix: str = "") -> dict[str, float]:
    """``summary/<prefix><name>`` copies of the :data:`HEADLINE` figures in ``metrics``
    (keys ``<prefix><name>``)."""
    return {f"summary/{prefix}{m}": metrics[f"{prefix}{m}"] for m in HEADLINE
            if f"{prefix}{m}" in metrics}


def short_run_names(params: list[dict], fallback: list[str]) -> list[str]:
    """Run names that fit the UI's column: a method's ``name`` with only the knobs whose
    values differ between the evaluated runs of that method (``chain(gamma=2)`` beside
    ``chain(gamma=4)``, but ``salf`` alone), e.g. ``salf(batch=4,depth=6,nodes=16,...)``
    becomes ``salf``. A label given by hand (not the automatic ``name(k=v,...)``) is
    kept, and so is every full label if two short names would be the same."""
    full = [str(p.get("label") or p.get("name") or f) for p, f in zip(params, fallback)]
    out = [label if not p.get("name") or label != auto_label(p) else short
           for p, label, short in zip(params, full, distinct_knobs(params))]
    return out if len(set(out)) == len(out) else full


def method_params(label: str, name: str, params: dict) -> dict:
    """The ``method.*`` params of one evaluated method: its registered ``name``
    (``chain``, ``salf``, ...), its table ``label`` and its settings (paths and all)."""
    return {"name": name, "label": label, **params}


def log_best(tracker, rows: list[dict], prefix: str = "",
             metrics: tuple[str, ...] = ("speedup", "tau", "tokens_per_s")) -> None:
    """``{prefix}best_<metric>`` (the largest over ``rows``) for each of ``metrics``
    present, and tags ``{prefix}best_<metric>_method`` naming the row that holds it; the
    best row's 95% interval too where it has one (``{prefix}best_speedup_lo`` /
    ``_hi``)."""
    values, tags = {}, {}
    for m in metrics:
        have = [r for r in rows if isinstance(r.get(m), (int, float))
                and not math.isnan(r[m])]
        if have:
            best = max(have, key=lambda r: r[m])
            values[f"{prefix}best_{m}"] = best[m]
            tags[f"{prefix}best_{m}_method"] = str(best.get("method"))
            for end in ("lo", "hi"):
                v = best.get(f"{m}_{end}")
                if isinstance(v, (int, float)) and not math.isnan(v):
                    values[f"{prefix}best_{m}_{end}"] = v
    tracker.log_metrics({**values, **{f"summary/{k}": v for k, v in values.items()}})
    tracker.set_tags(tags)

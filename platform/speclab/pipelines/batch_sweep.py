"""Stage: the evaluate job's batch-size sweep (``decoding.batch_sizes``).

Every method is evaluated at each batch size as :func:`speclab.pipelines.actor_eval.evaluate_pair`
evaluates it at one (the paired protocol, AR timed at the SAME batch size; each size's
table, plots and ``best_*`` under the prefix ``batch_<size>/`` of the job's run). Then,
per size, plain decoding's tokens/s, the best fixed method and each ``budget: auto``
method with their speedups and intervals (:func:`speclab.bench.auto_sweep`, the table
``speclab bench --batch-sizes ... --auto`` prints), printed and logged as
``batch_sweep.txt`` / ``batch_sweep.json``, the speedup-against-batch-size plot
``batch_scaling.png``, and one child run per method whose metrics have the batch size
as their step (MLflow's charts draw each figure against it).
"""

from __future__ import annotations

import json
from typing import Any

from speclab.evaluation import MethodRun
from speclab.pipelines.actor_eval import evaluate_pair
from speclab.pipelines.method_runs import child_run_name, method_params, uniform_metrics


def batch_sweep(cfg: Any, target: str, draft: str | None, prompts: list[list[int]],
                tracker) -> list[dict]:
    """Evaluate ``cfg``'s methods at each of ``cfg.decoding.batch_sizes`` and log the
    sweep to ``tracker`` (see the module docstring). Returns every row (AR first at
    each size), each with its ``batch_size``."""
    from speclab.bench import auto_sweep, batch_plot, crossover, format_crossover, format_sweep

    runs = cfg.method_list()
    labels = [MethodRun(m.name, m.params(), m.label or "").name for m in runs]
    autos = [label for label, m in zip(labels, runs, strict=True) if m.budget == "auto"]
    rows: list[dict] = []
    for size in cfg.decoding.batch_sizes:
        print(f"[evaluate] batch size {size}", flush=True)
        decoding = cfg.decoding.model_copy(update={"batch_size": size, "batch_sizes": None})
        block = evaluate_pair(cfg.model_copy(update={"decoding": decoding}), target, draft,
                              prompts, tracker, prefix=f"batch_{size}/", children=False)
        rows += [{**r, "batch_size": size} for r in block]
    sweep = auto_sweep(rows, autos)
    cross = crossover(rows)
    text = format_crossover(cross)
    if sweep:
        text = ("per batch size: plain decoding, the best fixed method, auto (speedups over "
                f"AR at that size, 95% intervals)\n{format_sweep(sweep)}\n\n{text}")
    print(f"\n[evaluate] batch sweep {cfg.decoding.batch_sizes}\n{text}", flush=True)
    tracker.log_text(text, "batch_sweep.txt")
    tracker.log_text(json.dumps({"rows": rows, "auto_sweep": sweep, "crossover": cross},
                                indent=1, default=str), "batch_sweep.json")
    tracker.log_figure(batch_plot(rows, f"T={cfg.decoding.temperature}, "
                                        f"{cfg.models.target}"), "batch_scaling.png")
    tracker.set_tags({"mlflow.note.content": (  # the run page's description
        f"**Batch sweep {cfg.decoding.batch_sizes}** over {len(prompts)} prompts "
        f"(each size's table: `batch_<size>_results`).\n\n```\n{text}\n```")})
    settings = {"ar": method_params("ar", "ar", {})} | {
        label: method_params(label, m.name, m.params())
        for label, m in zip(labels, runs, strict=True)}
    for label, params in settings.items():  # a child per method: figures against size
        mine = [r for r in rows if r["method"] == label]
        with tracker.child(child_run_name(tracker, label), {"method": params}) as child:
            child.set_tags({"kind": "method", "method": label})
            for row, metrics in zip(mine, uniform_metrics(mine, skip=("batch_size",)),
                                    strict=True):
                child.log_metrics(metrics, step=row["batch_size"])
    return rows

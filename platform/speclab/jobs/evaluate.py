"""Evaluate decoding methods over a prompt set on Ray actors that hold the models.

    python -m jobs.evaluate --config experiments/smoke/evaluate.yaml [key=value ...]

Prompts are spread over ``resources.num_actors`` actors; each actor times every method
in pairs with the AR baseline, prompt by prompt, over ``decoding.timing_passes`` passes
(:func:`speclab.evaluation.interleaved_comparison`), so a wall-clock ratio only ever
compares two runs that were adjacent in time on the same cores. The driver merges the
counters and pairs, prints the table (speedup: the median paired ratio with its 95%
interval, beside the ratio of totals, the engine's overhead against the measured
forward costs and a ``noisy`` flag) and logs params, metrics, the resolved config, the
table (CSV/JSON), the forward cost curves and plots (PNG) to MLflow. ``orderings``
(pairs of method labels) adds each one's median paired tau ratio over the prompts with
its interval and verdict (:mod:`speclab.orderings`), printed and logged as
``orderings.csv`` / ``orderings.json``.
"""

from __future__ import annotations

import sys
import time

from speclab.models.registry import resolve_models
from speclab.orderings import Ordering, paired_rows
from speclab.pipelines.actor_eval import evaluate_pair, tokenized_prompts
from speclab.pipelines.batch_sweep import batch_sweep
from speclab.pipelines.cli import start_job
from speclab.pipelines.comparison import log_orderings
from speclab.raylib import init_ray
from speclab.tracking import run_link, running_ui_port


def main(argv: list[str] | None = None) -> int:
    job = start_job("evaluate", __doc__, argv)
    cfg, tracker = job.cfg, job.tracker

    t_start = time.perf_counter()
    where = init_ray(job.address, cfg.ray.num_cpus)
    print(f"[evaluate] running on {where}", flush=True)
    target, draft = resolve_models(cfg.models.target, cfg.models.draft)
    if any(m.needs_draft_model for m in cfg.method_list()) and not draft:
        print("error: models.draft: the methods need a draft model", file=sys.stderr)
        return 2
    try:  # tokenise on the driver (fails fast on bad data); actors get token ids
        prompts = tokenized_prompts(cfg, target)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with tracker as t:
        t.set_tags({"job": "evaluate", "ray": where})
        if cfg.decoding.batch_sizes:
            batch_sweep(cfg, target, draft, prompts, t)
        else:
            rows = evaluate_pair(cfg, target, draft, prompts, t)
            if cfg.orderings:
                print("[evaluate] orderings, paired over prompts (median tau ratio - 1):\n"
                      + log_orderings(t, paired_rows(rows, [
                          Ordering(o.above, o.below, o.claim) for o in cfg.orderings])),
                      flush=True)
        t.log_metrics({"wall_s": time.perf_counter() - t_start})
    if tracker.run_id:
        port = running_ui_port(str(tracker.uri))  # the ui record, read once
        local = "" if port or str(tracker.uri).startswith("http") else " (after `speclab ui`)"
        print(f"\n[evaluate] MLflow run {tracker.run_id}: {run_link(tracker, port or 5000)}{local}",
              flush=True)
    return 0

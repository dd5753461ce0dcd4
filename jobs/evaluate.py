"""Evaluate decoding methods over a prompt set on Ray actors that hold the models.

    python -m jobs.evaluate --config experiments/smoke/evaluate.yaml [key=value ...]

Prompts are spread over ``resources.num_actors`` actors; each actor runs every method
over its prompts one after another with the AR baseline re-run before each method
(A B A B), so wall-clock ratios never compare runs that shared cores differently. The
driver merges the counters, prints the table and logs params, metrics, the resolved
config, the table (CSV/JSON) and plots (PNG) to MLflow.
"""

from __future__ import annotations

import sys
import time

import jobs  # noqa: F401  (makes speclab importable from a plain checkout)
from jobs._cli import load_or_exit, parse_job_args
from speclab.config import ExperimentConfig
from speclab.tracking import TrackingUnavailable, open_tracker


def _plots(rows: list[dict], runs) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = {}
    names = [r["method"] for r in rows]
    for metric, fname in (("tau", "tau_per_method.png"), ("tokens_per_s", "tokens_per_s.png")):
        fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(rows)), 3.5))
        ax.bar(range(len(rows)), [r[metric] for r in rows])
        ax.set_xticks(range(len(rows)), names, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel(metric)
        fig.tight_layout()
        figs[fname] = fig
    chain = sorted((run.gamma, row) for run, row in zip(runs, rows[1:]) if run.name == "chain")
    if len(chain) >= 2:
        fig, ax = plt.subplots(figsize=(4.5, 3.5))
        ax.plot([g for g, _ in chain], [r["speedup"] for _, r in chain], "o-", label="measured")
        ax.plot([g for g, _ in chain], [r["predicted_speedup"] for _, r in chain], "s--",
                label="predicted (Thm 3.8)")
        ax.set_xlabel("gamma")
        ax.set_ylabel("speedup over AR")
        ax.legend()
        fig.tight_layout()
        figs["speedup_vs_gamma.png"] = fig
    return figs


def main(argv: list[str] | None = None) -> int:
    args = parse_job_args(__doc__, argv)
    cfg = load_or_exit(ExperimentConfig, args.config, args.overrides)
    config = cfg.model_dump(mode="json")
    try:  # a remote tracking server is checked before any expensive work
        tracker = open_tracker(cfg.tracking.enabled, cfg.tracking.uri, cfg.tracking.experiment,
                               cfg.tracking.run_name or cfg.name, config)
    except TrackingUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    import ray

    from speclab.evaluation import MethodRun, Totals, format_table, summarize
    from speclab.models.registry import resolve_models
    from speclab.raylib import init_ray

    t_start = time.perf_counter()
    where = init_ray(args.address or cfg.ray.address, cfg.ray.num_cpus)
    print(f"[evaluate] running on {where}", flush=True)
    target, draft = resolve_models(cfg.models.target, cfg.models.draft)
    runs = cfg.method_list()
    method_runs = [MethodRun(m.name, m.params(), m.label or "") for m in runs]
    if any(r.method != "ar" for r in method_runs) and not draft:
        print("error: models.draft: the methods need a draft model", file=sys.stderr)
        return 2

    from speclab.api import Decoder
    from speclab.data.prompts import load_prompts

    # tokenise on the driver (fails fast on bad data) and ship token ids to the actors
    tok_dec = Decoder.from_pretrained(target)
    try:
        texts = load_prompts(cfg.data.prompts, cfg.data.num_prompts, cfg.data.context_chars,
                             cfg.data.path, cfg.data.seed)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    prompts = [tok_dec.encode(t) for t in texts]
    del tok_dec
    n_act = min(cfg.resources.num_actors, len(prompts))
    shards = [prompts[i::n_act] for i in range(n_act)]
    gen = cfg.decoding.model_dump()
    device = "cuda" if cfg.resources.num_gpus_per_actor > 0 else cfg.models.device

    @ray.remote
    class EvalWorker:
        """Holds the target and draft; evaluates methods over a shard of prompts."""

        def __init__(self) -> None:
            from speclab.api import Decoder

            self.dec = Decoder.from_pretrained(target, draft, cfg.models.dtype, device)

        def run(self, shard: list[list[int]]) -> dict:
            from speclab.evaluation import interleaved_comparison

            return interleaved_comparison(self.dec, method_runs, shard, gen)

    actors = [EvalWorker.options(num_cpus=cfg.resources.num_cpus_per_actor,
                                 num_gpus=cfg.resources.num_gpus_per_actor).remote()
              for _ in range(n_act)]
    parts = ray.get([a.run.remote(s) for a, s in zip(actors, shards)])
    for a in actors:
        ray.kill(a)

    merged: dict[str, dict] = {}
    for part in parts:
        for name, res in part.items():
            slot = merged.setdefault(name, {"run": res["run"], "totals": Totals(), "ar": Totals()})
            slot["totals"].merge(res["totals"])
            slot["ar"].merge(res["ar"])
    first = merged[method_runs[0].name]
    greedy = cfg.decoding.temperature == 0
    # outputs are in actor-shard order; the AR block of the first method is the reference
    reference = first["ar"].outputs if greedy else None
    rows = [summarize(MethodRun("ar"), first["ar"], first["ar"], reference)]
    for run in method_runs:
        m = merged[run.name]
        rows.append(summarize(run, m["totals"], m["ar"], reference))
    print(format_table(rows), flush=True)

    with tracker as t:
        for run_cfg, run, row in zip([None, *runs], [MethodRun("ar"), *method_runs], rows):
            t.log_metrics({f"{run.key}.{k}": v for k, v in row.items()})
            if run_cfg is not None and run_cfg.name == "chain":
                t.log_metrics({"chain.speedup": row["speedup"], "chain.tau": row["tau"]},
                              step=run_cfg.gamma)
        best = max(rows[1:], key=lambda r: r["speedup"]) if len(rows) > 1 else rows[0]
        t.log_metrics({"best_speedup": best["speedup"], "prompts": len(prompts),
                       "wall_s": time.perf_counter() - t_start})
        t.set_tags({"best_method": best["method"], "ray": where})
        t.log_table(rows, "results")
        t.log_text(format_table(rows), "results.txt")
        for name, fig in _plots(rows, runs).items():
            t.log_figure(fig, name)
    if tracker.run_id:
        print(f"\n[evaluate] MLflow run {tracker.run_id}; browse it with: speclab ui", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

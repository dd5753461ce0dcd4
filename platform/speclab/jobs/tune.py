"""Ray Tune sweep over speculative-decoding hyperparameters, tracked in MLflow.

    python -m jobs.tune --config experiments/smoke/tune.yaml [key=value ...]

The ``sweep`` section names the search space as dotted paths into this same config
(``method.gamma``, ``method.salf_threshold``, ``head.w_rej`` ...; the groups a sweep
may carry depend on its ``kind``: :data:`speclab.config.jobs.TUNE_GROUPS`; with
``method.name`` swept, ``method`` holds the knobs of every swept method and each trial
keeps its own method's), the search (``grid``,
``random``, ``optuna``), the scheduler (``fifo``, ``asha``), trials, concurrency, the
objective (``metric``/``mode``; e.g. ``predicted_speedup`` from the SpecDec++ cost
model, eq. 2.1 with the trial's forward counts and t_draft / t_target measured ONCE per
sweep, so noisy machines still rank trials stably) and
constraints (``floor``: e.g. an accuracy floor for AASD with ``task``).

* ``kind: decode`` trials evaluate ``method`` on the prompt set with the models cached
  per trial process (``speclab.sweep``).
* every other kind is a trained family's trial kind
  (:class:`speclab.families.spec.SweepSpec`, looked up by ``sweep.kind``): its inputs
  are checked on the driver, its data generated once per sweep, and each trial trains
  with Ray Train in chunks reporting a held-out figure (ASHA), then evaluates with the
  trial's artifact. Built in: ``train_head`` (SpecDec++ acceptance heads, then
  ``specdecpp``), ``eagle`` (EAGLE-family drafters: the ``eagle`` group's loss, HASS K /
  steps / weights, TALF trees; then ``method`` ``eagle``), ``atspeed`` (AtSpeed drafters
  with ``rec_eval.draft_loss`` / ``rec_eval.align_alpha``, then beam SD: AS@K, WS@K; the
  best config is a ``recommend_eval`` config); a family from a plugin sweeps its
  ``drafter`` group the same way.
(Training trials: :mod:`speclab.pipelines.tune_trials`.)

Devices: every trial reserves ``sweep.trial_cpus`` CPUs and ``sweep.trial_gpus`` GPUs
(default: 1 with ``models.device`` cuda, or auto on a cluster with GPUs; else 0), so Ray
gives each CUDA trial a GPU of its own; every model a trial loads is in ``models.dtype``
on that GPU (:func:`speclab.sweep.trial_device`), and t_draft / t_target are measured
there too (in a Ray task that reserves what a trial does: the driver may have no GPU).
A device that contradicts ``sweep.trial_gpus`` or the cluster is refused before any work.
``trial_starts.jsonl`` in the sweep folder records each trial's device and the GPUs Ray
made visible to it. In ``train_head`` / ``eagle`` / ``atspeed`` sweeps the Ray Train
workers inside a trial reserve their own resources (``scaling``) besides the trial's: with
``scaling.use_gpu``, each running trial needs ``sweep.trial_gpus`` + ``scaling.num_workers``
GPUs.

MLflow: the job's run is the parent (search space, best trial and config, the results
table, plots of the objective against each parameter); each trial is a child run with
its params, metrics and status (ok, stopped by ASHA, or failed with its error). The best config is
written as ``best_config.yaml`` (a ready ``evaluate`` config) in the sweep folder and
logged. ``train.resume=true output.run_name=X`` restores an interrupted sweep with
``Tuner.restore``: finished trials are kept, unfinished ones continue.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

from speclab.config import TuneJob
from speclab.config.jobs import JOB_CONFIGS, tune_groups
from speclab.families.registry import family_of_method, sweep_kinds
from speclab.families.spec import TrainedFamily, load
from speclab.pipelines.cli import run_dirs, start_job


@dataclass
class Inputs:
    """Everything a sweep needs, checked on the driver before Ray starts."""

    target: str
    draft: str | None
    prompts: list[list[int]]
    references: tuple[str, list[str]] | None
    train_prep: object | None  # what a trained family's sweep prepared (its ``prepare``)


def sweep_family(cfg: TuneJob) -> TrainedFamily | None:
    """The family whose training trials the sweep runs (None: ``decode``)."""
    return sweep_kinds().get(cfg.sweep.kind)


def prepare(cfg: TuneJob) -> Inputs:
    """Resolve models, tokenise prompts (or a task's); ValueError on bad input."""
    from speclab.api import Decoder
    from speclab.models.loading import resolve_source
    from speclab.models.registry import resolve_models
    from speclab.pipelines.actor_eval import tokenized_prompts

    sw = cfg.sweep
    if sw is None:
        raise ValueError("sweep: the tune job needs a sweep section")
    base = cfg.sweep_base()
    for path in sw.space:  # every dotted path must exist in the config
        node = base
        for key in path.split("."):
            if not isinstance(node, dict) or key not in node:
                raise ValueError(f"sweep.space: {path!r} is not a field of the config "
                                 f"(a {sw.kind} sweep has groups "
                                 f"{', '.join(tune_groups(sw.kind))})")
            node = node[key]
    if "models.device" in sw.space:  # trials reserve resources once per sweep
        raise ValueError("sweep.space: 'models.device' cannot be swept: every trial reserves "
                         "the same resources (sweep.trial_gpus); run a sweep per device")
    fam, train_prep = sweep_family(cfg), None
    if fam is not None:  # the training data is generated once per sweep
        fixed = sorted(p for p in sw.space if p.startswith("distill.")
                       or p in fam.sweep.fixed_fields)
        if fam.sweep.generate and fixed:
            raise ValueError(f"sweep.space: {', '.join(map(repr, fixed))} cannot be swept: a "
                             f"{sw.kind} sweep generates its {fam.name} training data once, "
                             "from the base config, for every trial; run a sweep per value")
        train_prep, draft = load(fam.sweep.prepare)(cfg) if fam.sweep.prepare else (None,
                                                                                     None)
        if not fam.sweep.times:  # no prompts, no forward costs (AtSpeed: beam SD)
            return Inputs("", None, [], None, train_prep)
        target = train_prep.target
    else:
        target, draft = resolve_models(cfg.models.target, cfg.models.draft)
        target = resolve_source(target, "models.target")
        draft = resolve_source(draft, "models.draft") if draft else None
    references = None
    if sw.task:
        from speclab.data.tasks import load_task

        exs = load_task(sw.task, cfg.data.num_prompts, cfg.retrieval.context_chars,
                        cfg.retrieval.reference_chars)
        dec = Decoder.from_pretrained(target)
        prompts = [dec.encode(e.prompt) for e in exs]
        references = (exs[0].metric, [e.reference for e in exs])
    else:
        prompts = tokenized_prompts(cfg, target)
    return Inputs(target, draft, prompts, references, train_prep)


def _tuner(cfg: TuneJob, inputs: Inputs, sweep_dir: Path, times: tuple,
           resources: dict[str, float], device: str):
    """A fresh Tuner, or the interrupted one restored (``train.resume``); every trial
    reserves ``resources`` and loads its models on ``device``."""
    from ray import tune

    from speclab.sweep import decode_trial, param_space, trial_base

    sw, base = cfg.sweep, trial_base(cfg, device)  # cuda: each trial's own cuda:0
    common = {"base": base, "target": inputs.target, "draft": inputs.draft,
              "prompts": inputs.prompts, "t_draft": times[0], "t_target": times[1],
              "run_dir": str(sweep_dir)}
    fam = sweep_family(cfg)
    if fam is None:
        fn = tune.with_parameters(decode_trial, references=inputs.references, **common)
    else:  # a trained family's trial: the data it generated once, the target's vocabulary
        p = inputs.train_prep
        fn = tune.with_parameters(load(fam.sweep.trial), data_dir=str(sweep_dir / "data"),
                                  vocab=p.vocab, eos=p.eos, **common)
    fn = tune.with_resources(fn, resources)
    exp_dir = sweep_dir / "tune"
    if cfg.train.resume and tune.Tuner.can_restore(str(exp_dir)):
        print(f"[tune] restoring the sweep in {exp_dir}", flush=True)
        return tune.Tuner.restore(str(exp_dir), fn, resume_unfinished=True,
                                  resume_errored=False, restart_errored=False)
    search, scheduler = None, None
    if sw.search == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        search = OptunaSearch(metric="objective", mode=sw.mode, seed=cfg.train.seed)
    if sw.scheduler == "asha":
        from ray.tune.schedulers import ASHAScheduler

        if fam is not None:  # intermediate reports carry a held-out loss
            steps = load(fam.sweep.steps)(cfg) if fam.sweep.steps else cfg.train.steps
            rungs = max(2, math.ceil(steps / cfg.train.report_every))
            scheduler = ASHAScheduler(metric=fam.sweep.heldout_metric, mode="min", max_t=rungs,
                                      grace_period=sw.grace_period, reduction_factor=2)
        else:
            scheduler = ASHAScheduler(metric="objective", mode=sw.mode,
                                      grace_period=sw.grace_period)
    return tune.Tuner(
        fn, param_space=param_space(cfg),
        tune_config=tune.TuneConfig(search_alg=search, scheduler=scheduler,
                                    num_samples=sw.num_samples,
                                    max_concurrent_trials=sw.max_concurrent),
        run_config=tune.RunConfig(name="tune", storage_path=str(sweep_dir),
                                  failure_config=tune.FailureConfig(max_failures=0),
                                  verbose=1))


def _figures(rows: list[dict], space: list[str], metric: str) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = {}
    ok = [r for r in rows if r["status"] == "ok" and metric in r]
    methods = sorted({str(r["params"].get("method.name", "")) for r in ok})
    for path in space:
        fig, ax = plt.subplots(figsize=(5, 3.6))
        xs_all = [r["params"][path] for r in ok]
        numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs_all)
        labels = sorted({str(x) for x in xs_all})
        for method in methods:  # one colour per swept method (one series without)
            mine = [r for r in ok if str(r["params"].get("method.name", "")) == method]
            xs = [r["params"][path] if numeric else labels.index(str(r["params"][path]))
                  for r in mine]
            ax.plot(xs, [r[metric] for r in mine], "o", label=method or None, alpha=0.8)
        if not numeric:
            ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
        if any(methods):
            ax.legend(title="method", fontsize=8)
        ax.set_title(f"{metric} per trial vs {path}", fontsize=10)
        ax.set_xlabel(path)
        ax.set_ylabel(metric)
        fig.tight_layout()
        figs[f"{metric}_vs_{path.replace('.', '_')}.png"] = fig
    return figs


#: metrics in the results table
_SHOWN = ("speedup", "tau", "predicted_speedup", "accuracy", "accuracy_ratio", "heldout_bce",
          "as_at_k", "ws_at_k", "recall_at_k", "val_loss", "val_top1", "engine_tau")


def _best_config(cfg: TuneJob, best: dict, sweep_dir: Path, target: str) -> dict:
    """The best trial as a ready config: ``evaluate`` (decode, or a trained family's
    trial with its own artifact in the family's method field) or what the family's
    ``best`` hook makes of it (AtSpeed: ``recommend_eval`` with the target and the
    trial's drafter given, so nothing is retrained)."""
    from speclab.sweep import trial_config

    fam = sweep_family(cfg)
    best_cfg = trial_config(cfg.sweep_base(), best["params"])
    data = best_cfg.model_dump(mode="json", exclude_none=True)
    trial_dir = sweep_dir / "trials"
    job = "evaluate"
    if fam is not None and fam.sweep.best:
        job, data = load(fam.sweep.best)(cfg, best["params"], data, trial_dir, target,
                                         best["trial"])
    elif fam is not None:  # the best trial's own artifact
        data["method"][fam.artifact_field] = str(trial_dir / fam.sweep.artifact.format(
            family=fam.name, trial=best["trial"]))
    keep = JOB_CONFIGS[job].model_fields  # only the job's groups
    data = {k: v for k, v in data.items() if k in keep}
    data.update({"name": f"{cfg.name}-best", "job": job})
    return data


def trial_label(params: dict) -> str:
    """A trial's short readable run name from its swept values: a swept method name
    first, then ``knob=value`` by the last part of each path (``salf nodes=6``)."""
    name = params.get("method.name")
    parts = [str(name)] if name is not None else []
    for path, value in params.items():
        if path != "method.name":
            shown = f"{value:.4g}" if isinstance(value, float) else str(value)
            parts.append(f"{path.rsplit('.', 1)[-1]}={shown}")
    return " ".join(parts)[:60]


def record(cfg: TuneJob, results, tracker, sweep_dir: Path,
           target: str = "") -> dict | None:
    """Child runs per trial, the parent's table / best config / plots; returns the best row."""
    import yaml

    from speclab.evaluation import format_table

    sw = cfg.sweep
    rows = []
    for res in results:
        params = (res.config or {}).get("params", {})
        trial = (res.metrics or {}).get("trial_id") or Path(res.path or "?").name[:24]
        stopped = not res.error and "objective" not in (res.metrics or {})  # by ASHA
        row = {"trial": trial, "params": params,
               "status": "failed" if res.error else "stopped" if stopped else "ok"}
        metrics = {k: v for k, v in (res.metrics or {}).items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)
                   and math.isfinite(v)}
        if res.error:
            row["error"] = str(res.error).strip().splitlines()[-1][:500]
        row.update({k: metrics[k] for k in (sw.metric, "objective", *_SHOWN, "step")
                    if k in metrics})
        rows.append(row)
        with tracker.child(trial_label(params) or f"{cfg.name}-{trial}", params) as c:
            c.set_tags({"status": row["status"], "trial": str(trial),
                        **({"error": row["error"]} if "error" in row else {})})
            if metrics:
                c.log_metrics(metrics)
    ok = [r for r in rows if r["status"] == "ok" and math.isfinite(r.get("objective", math.nan))]
    best = None
    if ok:
        best = (max if sw.mode == "max" else min)(ok, key=lambda r: r["objective"])
        data = _best_config(cfg, best, sweep_dir, target)
        path = sweep_dir / "best_config.yaml"
        path.write_text(f"# Run: .venv/bin/python -m jobs.{data['job']} --config {path}\n"
                        f"# Best trial of sweep {cfg.name}: {best['params']}\n"
                        + yaml.safe_dump(data, sort_keys=False))
        tracker.log_text(path.read_text(), "best_config.yaml")
        tracker.log_metrics({f"best_{sw.metric}": best.get(sw.metric, best["objective"]),
                             "best_objective": best["objective"]})
        tracker.set_tags({"best_trial": best["trial"], "best_params": str(best["params"]),
                          "best_config": str(path)})
    flat = [{"trial": r["trial"], "status": r["status"],
             **{f"param.{k}": v for k, v in r["params"].items()},
             **{k: v for k, v in r.items() if k not in ("trial", "status", "params")}}
            for r in rows]
    cols = [("trial", "{}"), ("status", "{}")] + [(f"param.{k}", "{}") for k in sw.space] + [
        (k, "{:.3f}") for k in dict.fromkeys((sw.metric, *_SHOWN)) if any(k in r for r in flat)]
    text = format_table(flat, list(dict.fromkeys(cols)))
    print(text, flush=True)
    tracker.log_table(flat, "sweep_results")
    tracker.log_text(text, "sweep_results.txt")
    tracker.log_metrics({"trials": len(rows), "failed_trials": len(rows) - len(ok)})
    tracker.log_text(yaml.safe_dump(cfg.model_dump(mode="json")["sweep"]), "search_space.yaml")
    for fname, fig in _figures(rows, list(sw.space), sw.metric).items():
        tracker.log_figure(fig, fname)
    return best


def _forward_times(cfg: TuneJob, target: str, draft: str | None,
                   prompt: list[int]) -> tuple[float, float]:
    """(t_draft, t_target) with the models as a trial loads them (``cfg.models``: the
    trial's dtype and device); ``t_draft`` is one EAGLE drafter forward in an eagle sweep
    or for method eagle. Both are read from the runners' own forward clocks
    (``ModelRunner.seconds``), which measure the work on the device, not the launch."""
    from speclab.evaluation import forward_times
    from speclab.sweep import load_models

    dec = load_models(cfg, target, draft)
    times = forward_times(dec, prompt)  # once per sweep (cost model)
    fam = sweep_family(cfg) or family_of_method(cfg.method.name)
    if fam is not None and fam.draft_time:  # a drafter, no draft LM
        times = (load(fam.draft_time)(dec, cfg, prompt), times[1])
    return times


def sweep_forward_times(cfg: TuneJob, inputs: Inputs, resources: dict[str, float],
                        device: str) -> tuple[float, float]:
    """The cost model's (t_draft, t_target), measured ONCE per sweep on the trials'
    ``device`` in ``models.dtype``: on a GPU in a Ray task that reserves what a trial
    does (``resources``; the driver may have no GPU, and Ray gives the task a GPU of its
    own), else here on the driver, before any trial runs."""
    from speclab.sweep import on_device

    args = (on_device(cfg, device), inputs.target, inputs.draft, inputs.prompts[0])
    if resources.get("gpu", 0) > 0:
        import ray

        task = ray.remote(num_cpus=resources["cpu"], num_gpus=resources["gpu"],
                          max_calls=1)(_forward_times)  # max_calls: its GPU memory freed
        return tuple(ray.get(task.remote(*args)))
    return _forward_times(*args)


def main(argv: list[str] | None = None) -> int:
    job = start_job("tune", __doc__, argv, prepare)
    cfg, tracker, inputs = job.cfg, job.tracker, job.inputs
    import ray

    from speclab.raylib import init_ray
    from speclab.sweep import trial_device, trial_resources

    storage, run_name = run_dirs(cfg)
    sweep_dir = storage / run_name
    where = init_ray(job.address, cfg.ray.num_cpus)
    try:  # the device against the cluster's GPUs, before any work
        resources = trial_resources(cfg, ray.cluster_resources().get("GPU", 0.0))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    device = trial_device(cfg, resources["gpu"])
    print(f"[tune] running on {where}; sweep folder {sweep_dir}; each trial reserves "
          f"{resources} and loads its models on {device} in {cfg.models.dtype}", flush=True)
    with tracker as t:
        t.set_tags({"job": "tune", "sweep_dir": str(sweep_dir), "kind": cfg.sweep.kind,
                    "trial_device": device, "trial_gpus": f"{resources['gpu']:g}"})
        times = (0.0, 0.0)
        fam = sweep_family(cfg)
        if fam is None or fam.sweep.times:
            times = sweep_forward_times(cfg, inputs, resources, device)
            t.log_metrics({"t_draft_s": times[0], "t_target_s": times[1]})
        if fam is not None and fam.sweep.generate:  # the training data, once per sweep
            load(fam.sweep.generate)(cfg, inputs, sweep_dir, t)
        results = _tuner(cfg, inputs, sweep_dir, times, resources, device).fit()
        best = record(cfg, results, t, sweep_dir, inputs.target)
    if best is None:
        print("[tune] no trial succeeded with a finite objective that met "
              f"sweep.floor {dict(cfg.sweep.floor)} (see the results table)", file=sys.stderr)
        return 1
    print(f"[tune] best {best['params']} -> {cfg.sweep.metric} "
          f"{best.get(cfg.sweep.metric, best['objective']):.3f}; "
          f"config: {sweep_dir / 'best_config.yaml'}", flush=True)
    return 0

"""Ray Tune glue for SD hyperparameter sweeps (used by :mod:`speclab.jobs.tune`).

* :func:`param_space` turns the ``sweep.space`` of a ``tune`` config (dotted paths ->
  grid / choice / uniform / loguniform / randint) into a Tune ``param_space``;
* :func:`trial_config` applies one trial's values to the base config and re-validates
  it as a ``tune`` config (:class:`speclab.config.TuneJob`, the groups of the sweep's
  kind), so a bad combination fails THAT trial with the field named;
* :func:`decode_trial` evaluates one method configuration on a prompt set with models
  cached per worker process (loaded once, not once per trial) and reports
  hardware-independent figures next to wall-clock ones, including the SpecDec++ cost
  model's predicted speedup (eq. 2.1 per generated token: ``t_target / (t_draft *
  draft forwards + t_target * target forwards)``, which is eq. 2.3 for chains and also
  right for trees that expand several nodes per draft forward) from ``t_draft`` /
  ``t_target`` measured once per sweep;
* training trials (acceptance heads, AtSpeed drafters) live in
  :mod:`speclab.pipelines.tune_trials` next to the Ray Train glue they use.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

from speclab.config import MethodConfig, TuneJob
from speclab.config.base import apply_override
from speclab.config.jobs import own_method_knobs

_MODELS: dict = {}  # (target, draft, dtype, device) -> Decoder, one per worker process


def param_space(cfg: TuneJob) -> dict:
    """``{"params": {dotted: tune domain}}`` from ``cfg.sweep.space``."""
    from ray import tune

    out = {}
    for path, p in cfg.sweep.space.items():
        if p.kind == "grid":
            out[path] = tune.grid_search(list(p.grid))
        elif p.kind == "choice":
            out[path] = (tune.grid_search(list(p.choice)) if cfg.sweep.search == "grid"
                         else tune.choice(list(p.choice)))
        elif p.kind == "uniform":
            out[path] = tune.uniform(*p.uniform)
        elif p.kind == "loguniform":
            out[path] = tune.loguniform(*p.loguniform)
        else:
            out[path] = tune.randint(*p.randint)
    return {"params": out}


def trial_config(base: dict, params: dict) -> TuneJob:
    """The config of one trial: ``base`` (a tune config's JSON dump, e.g.
    ``TuneJob.sweep_base()``) with ``params`` set and without the ``sweep``. With
    ``method.name`` among ``params``, ``method`` keeps only that method's knobs."""
    data = copy.deepcopy(base)
    data.setdefault("job", "tune")
    data.pop("sweep", None)
    for path, value in params.items():
        apply_override(data, path, value)
    if "method.name" in params and isinstance(data.get("method"), dict):
        data["method"] = own_method_knobs(data["method"])
    return TuneJob.from_dict(data)


def objective(metrics: dict, sweep: dict) -> float:
    """``metrics[sweep["metric"]]``, or the worst value for ``sweep["mode"]`` when a
    ``sweep["floor"]`` constraint fails (``sweep``: the validated section, dumped)."""
    ok = all(metrics.get(k, float("-inf")) >= v for k, v in sweep["floor"].items())
    if ok:
        return float(metrics[sweep["metric"]])
    return float("-inf") if sweep["mode"] == "max" else float("inf")


def _decoder(cfg: TuneJob, target: str, draft: str | None):
    from speclab.api import Decoder

    key = (target, draft, cfg.models.dtype, cfg.models.device)
    if key not in _MODELS:
        _MODELS[key] = Decoder.from_pretrained(target, draft, cfg.models.dtype,
                                               cfg.models.device)
    return _MODELS[key]


def evaluate_method(cfg: TuneJob, target: str, draft: str | None,
                    prompts: list[list[int]], references: tuple[str, list[str]] | None,
                    t_draft: float, t_target: float, method: MethodConfig | None = None
                    ) -> dict:
    """AR then ``method`` (default ``cfg.method``) on ``prompts``; the metrics a trial
    reports.

    ``references``: (metric name in :data:`speclab.text_metrics.METRICS`, one reference
    text per prompt) adds ``accuracy``, the target alone's ``ar_accuracy`` on the same
    prompts and their ratio ``accuracy_ratio`` (1 for a lossless method; a floor on it
    bounds what a relaxed method such as AASD may lose, whatever the model's quality).
    """
    from speclab.evaluation import MethodRun, interleaved_comparison, summarize

    dec = _decoder(cfg, target, draft)
    m = method if method is not None else cfg.method
    run = MethodRun(m.name, m.params(), m.label or "")
    res = interleaved_comparison(dec, [run], prompts, cfg.decoding.model_dump())[run.name]
    row = summarize(run, res["totals"], res["ar"], res["ar"].outputs)
    lat = t_draft * row["draft_calls_per_token"] + t_target * row["target_calls_per_token"]
    out = {k: float(row[k]) for k in ("speedup", "tokens_per_s", "tau", "acceptance_rate",
                                      "discard_rate", "target_calls_per_token")}
    out["predicted_speedup"] = t_target / lat if lat > 0 else 0.0
    out["identical_to_ar"] = float(bool(row.get("identical_to_ar")))
    if references is not None:
        from speclab.text_metrics import METRICS

        metric, refs = METRICS[references[0]], references[1]

        def score(outputs: list[list[int]]) -> float:
            texts = [dec.tokenizer.decode(o) for o in outputs]
            return sum(metric(t, r) for t, r in zip(texts, refs)) / len(texts)

        out["accuracy"] = score(res["totals"].outputs)
        out["ar_accuracy"] = score(res["ar"].outputs)
        out["accuracy_ratio"] = (out["accuracy"] / out["ar_accuracy"]
                                 if out["ar_accuracy"] > 0 else float(out["accuracy"] == 0))
    return out


def log_start(run_dir: str, params: dict) -> None:
    """Append this trial's params to ``trial_starts.jsonl`` (shows what (re)ran)."""
    import json

    Path(run_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(run_dir) / "trial_starts.jsonl", "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "params": params}) + "\n")


def decode_trial(config: dict, *, base: dict, target: str, draft: str | None,
                 prompts: list[list[int]], references: tuple[str, list[str]] | None,
                 t_draft: float,
                 t_target: float, run_dir: str) -> None:
    """Tune function trainable for decoding trials (one report)."""
    from ray import tune

    log_start(run_dir, config["params"])
    cfg = trial_config(base, config["params"])
    metrics = evaluate_method(cfg, target, draft, prompts, references, t_draft, t_target)
    metrics["objective"] = objective(metrics, base["sweep"])
    tune.report(metrics)

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
  :mod:`speclab.pipelines.tune_trials` next to the Ray Train glue they use;
* :func:`trial_resources` / :func:`trial_device`: what a trial reserves and where its
  models load. ``models.device`` is resolved as a Serve deployment's is against its
  ``num_gpus`` (:func:`speclab.config.jobs.device_for_gpus`), here against
  ``sweep.trial_gpus`` (default: 1 GPU per trial with ``cuda``, or ``auto`` on a cluster
  with GPUs; else 0). A trial with GPUs gets its own ``CUDA_VISIBLE_DEVICES`` from Ray,
  so every trial loads on ``cuda`` (its own ``cuda:0``); a trial without GPUs loads on
  the CPU even under ``auto`` (Ray may leave the node's GPUs visible to it). Every model
  a trial loads (target, draft, feature drafters, heads) is in ``models.dtype`` on that
  device, and the sweep's t_draft / t_target are measured there too (jobs.tune).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

from speclab.api import Decoder
from speclab.config import MethodConfig, TuneJob
from speclab.config.base import apply_override
from speclab.config.jobs import device_for_gpus, own_method_knobs
from speclab.evaluation import MethodRun, interleaved_comparison, summarize
from speclab.text_metrics import METRICS

_MODELS: dict = {}  # (target, draft, dtype, device, attention) -> Decoder, per process


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


def trial_gpus(cfg: TuneJob, cluster_gpus: float) -> float:
    """GPUs each trial of ``cfg``'s sweep reserves on a Ray cluster with ``cluster_gpus``
    GPUs: ``sweep.trial_gpus``, else 1 with a CUDA ``models.device`` (``cuda[:i]``, or
    ``auto`` where the cluster has GPUs), else 0.

    Raises ValueError naming ``models.device`` and ``sweep.trial_gpus`` when they
    contradict each other (the config refuses that already) or when trials would reserve
    GPUs that the cluster does not have (each would wait for them forever)."""
    device, gpus = cfg.models.device, cfg.sweep.trial_gpus
    if gpus is None:
        cuda = device.startswith("cuda") or (device == "auto" and cluster_gpus > 0)
        gpus = 1.0 if cuda else 0.0
    if gpus > 0 and cluster_gpus <= 0:  # (an autoscaling cluster: start a GPU node first)
        if device == "auto":
            raise ValueError(
                f"sweep.trial_gpus is {gpus:g} but the Ray cluster has no GPU: each trial "
                "would wait for one forever; leave sweep.trial_gpus out (models.device: "
                "'auto' then loads on the CPU) or run on a cluster with GPUs")
        raise ValueError(
            f"models.device: {device!r} but the Ray cluster has no GPU: each trial would "
            f"reserve {gpus:g} GPU (sweep.trial_gpus) and wait for it forever; run on a "
            "cluster with GPUs, or set models.device: auto (or cpu)")
    device_for_gpus(device, gpus, "sweep.trial_gpus", "each trial")
    return float(gpus)


def trial_device(cfg: TuneJob, gpus: float) -> str:
    """The device a trial that reserves ``gpus`` GPUs loads its models on: ``models.device``
    resolved as a Serve deployment's (:func:`speclab.config.jobs.device_for_gpus`), any CUDA
    device as ``cuda``: Ray gives a trial with GPUs a ``CUDA_VISIBLE_DEVICES`` of its own,
    in which ``cuda:0`` is its own GPU (``cuda:1`` of the config may not exist there)."""
    device = device_for_gpus(cfg.models.device, gpus, "sweep.trial_gpus", "each trial")
    return "cuda" if device.startswith("cuda") else device


def trial_resources(cfg: TuneJob, cluster_gpus: float) -> dict[str, float]:
    """What every trial reserves (``tune.with_resources``): ``{"cpu": sweep.trial_cpus,
    "gpu": trial_gpus(cfg, cluster_gpus)}``; ValueError as :func:`trial_gpus`."""
    return {"cpu": cfg.sweep.trial_cpus, "gpu": trial_gpus(cfg, cluster_gpus)}


def trial_base(cfg: TuneJob, device: str) -> dict:
    """The config every trial starts from (:meth:`TuneJob.sweep_base`, dumped) with
    ``models.device`` set to the trials' ``device`` (:func:`trial_device`)."""
    base = cfg.sweep_base()
    base["models"]["device"] = device
    return base


def on_device(cfg: TuneJob, device: str) -> TuneJob:
    """``cfg`` with ``models.device`` set to ``device`` (a trial's, :func:`trial_device`)."""
    return cfg.model_copy(update={"models": cfg.models.model_copy(update={"device": device})})


def load_models(cfg: TuneJob, target: str, draft: str | None) -> Decoder:
    """A fresh :class:`~speclab.api.Decoder` of ``target`` / ``draft`` in
    ``cfg.models.dtype`` on ``cfg.models.device`` (in a trial: the trial's device, see
    :func:`trial_device`) with ``cfg.models.attn_implementation``; the feature drafters
    and heads it builds load on the target's device and dtype."""
    m = cfg.models
    return Decoder.from_pretrained(target, draft, m.dtype, m.device,
                                   attn_implementation=m.attn_implementation)


def load_decoder(cfg: TuneJob, target: str, draft: str | None) -> Decoder:
    """:func:`load_models`, cached per worker process (loaded once, not once per trial)."""
    m = cfg.models
    key = (target, draft, m.dtype, m.device, m.attn_implementation)
    if key not in _MODELS:
        _MODELS[key] = load_models(cfg, target, draft)
    return _MODELS[key]


def evaluate_method(cfg: TuneJob, target: str, draft: str | None,
                    prompts: list[list[int]], references: tuple[str, list[str]] | None,
                    t_draft: float, t_target: float, method: MethodConfig | None = None
                    ) -> dict:
    """``method`` (default ``cfg.method``) paired with AR on ``prompts`` (the paired
    timing protocol, :func:`speclab.evaluation.interleaved_comparison`, over
    ``decoding.timing_passes`` passes); the metrics a trial reports: ``speedup`` (the
    median paired ratio) with ``speedup_lo`` / ``speedup_hi`` (its 95% interval),
    ``speedup_totals``, ``noisy`` (0/1), ``engine_overhead`` (NaN when not measured) and
    the hardware-independent figures.

    ``references``: (metric name in :data:`speclab.text_metrics.METRICS`, one reference
    text per prompt) adds ``accuracy``, the target alone's ``ar_accuracy`` on the same
    prompts and their ratio ``accuracy_ratio`` (1 for a lossless method; a floor on it
    bounds what a relaxed method such as AASD may lose, whatever the model's quality).
    """
    dec = load_decoder(cfg, target, draft)
    m = method if method is not None else cfg.method
    run = MethodRun(m.name, m.params(), m.label or "")
    res = interleaved_comparison(dec, [run], prompts, cfg.decoding.generate_kwargs())[run.name]
    row = summarize(run, res["totals"], res["ar"], res["ar"].outputs)
    lat = t_draft * row["draft_calls_per_token"] + t_target * row["target_calls_per_token"]
    out = {k: float(row[k]) for k in ("speedup", "speedup_lo", "speedup_hi", "speedup_totals",
                                      "noisy", "engine_overhead", "tokens_per_s", "tau",
                                      "acceptance_rate", "discard_rate",
                                      "target_calls_per_token")}
    out["predicted_speedup"] = t_target / lat if lat > 0 else 0.0
    out["identical_to_ar"] = float(bool(row.get("identical_to_ar")))
    if references is not None:
        metric, refs = METRICS[references[0]], references[1]

        def score(outputs: list[list[int]]) -> float:
            texts = [dec.tokenizer.decode(o) for o in outputs]
            return sum(metric(t, r) for t, r in zip(texts, refs)) / len(texts)

        out["accuracy"] = score(res["totals"].outputs)
        out["ar_accuracy"] = score(res["ar"].outputs)
        out["accuracy_ratio"] = (out["accuracy"] / out["ar_accuracy"]
                                 if out["ar_accuracy"] > 0 else float(out["accuracy"] == 0))
    return out


def log_start(run_dir: str, params: dict, base: dict | None = None) -> None:
    """Append this trial's params to ``trial_starts.jsonl`` (shows what (re)ran), with
    the device its models load on (``base``: the trials' base config, :func:`trial_base`)
    and the GPUs Ray made visible to it (``CUDA_VISIBLE_DEVICES``; None: not set)."""
    import json

    line = {"pid": os.getpid(), "params": params}
    if base is not None:
        line.update({"device": base["models"]["device"],
                     "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")})
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(run_dir) / "trial_starts.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


def decode_trial(config: dict, *, base: dict, target: str, draft: str | None,
                 prompts: list[list[int]], references: tuple[str, list[str]] | None,
                 t_draft: float,
                 t_target: float, run_dir: str) -> None:
    """Tune function trainable for decoding trials (one report)."""
    from ray import tune

    log_start(run_dir, config["params"], base)
    cfg = trial_config(base, config["params"])
    metrics = evaluate_method(cfg, target, draft, prompts, references, t_draft, t_target)
    metrics["objective"] = objective(metrics, base["sweep"])
    tune.report(metrics)

"""The EAGLE family in Ray Tune (``sweep.kind: eagle``): what a sweep checks, generates
once and measures once, and the trial that trains an EAGLE-family drafter.

An ``eagle`` sweep trains a drafter per trial (the ``eagle`` group: ``loss``, HASS
``hass_k`` / ``hass_steps`` / ``w_reg`` / ``w_cls``, TALF trees) with Ray Train on
``feat`` / ``feat_tree`` data generated once per sweep, reports ``val_loss``,
``val_top1`` (and ``val_top1_miss`` = 1 - val_top1, what ASHA minimises: comparable
across loss weights) and the engine-measured ``engine_tau`` per chunk, then decodes
``method`` (``eagle``) with the trial's drafter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from speclab.config.jobs import check_data_prompt
from speclab.config.method import parse_method
from speclab.decoding.runner import ModelRunner
from speclab.evaluation import median_call_time
from speclab.families.eagle.model import build_eagle, load_eagle, trained_meta
from speclab.families.eagle.stages import generate_features, prepare_eagle, save_final_eagle
from speclab.families.eagle.task import EagleTaskConfig
from speclab.families.objectives import objective as objective_entry
from speclab.models.loading import resolve_source
from speclab.pipelines.tune_trials import train_in_chunks
from speclab.sweep import evaluate_method, log_start, objective, trial_config

#: the fields an eagle sweep's feature data depends on (with every ``distill.*`` field)
EAGLE_DATA_FIELDS = ("eagle.data", "eagle.data_prompt", "eagle.feature_layers",
                     "eagle.talf_top_k", "eagle.talf_depth")


def _swept(cfg: Any, field: str, default) -> list:
    swept = cfg.sweep.space.get(field)
    values = list((swept.grid or swept.choice or []) if swept is not None else [])
    return list(dict.fromkeys([default, *values]))


def swept_losses(cfg: Any) -> list[str]:
    """The EAGLE-family losses an ``eagle`` sweep may train (``eagle.loss`` and the
    values of a swept ``eagle.loss``), so their data is generated once up front."""
    return _swept(cfg, "eagle.loss", cfg.eagle.loss)


def swept_eagle_kinds(cfg: Any) -> set[str]:
    """The data kinds an ``eagle`` sweep's trials read: every swept loss with every
    swept ``eagle.version`` that can train it (an objective's ``requires``; a
    combination that cannot train fails its trial, naming the field)."""
    kinds = set()
    for loss in swept_losses(cfg):
        obj = objective_entry(loss, "eagle", "sweep.space: eagle.loss")
        for v in _swept(cfg, "eagle.version", cfg.eagle.version):
            group = cfg.eagle.model_copy(update={"version": v})
            if obj.fits(group):
                kinds.add(obj.kind_for(group))
    return kinds


def prepare_sweep(cfg: Any) -> tuple[Any, None]:
    """The target and corpus, ``eagle.init_from`` resolved and checked."""
    return prepare_eagle(cfg), None


def generate_sweep(cfg: Any, inputs: Any, sweep_dir: Path, tracker) -> None:
    """The feature data of every swept objective, once per sweep."""
    generate_features(cfg, inputs.train_prep, sweep_dir / "data", tracker,
                      swept_eagle_kinds(cfg))


def validate_sweep(cfg: Any) -> None:
    """An eagle sweep evaluates method ``eagle`` with each trial's drafter; every swept
    objective's own checks (HASS's K against the stored top-k) hold for every swept
    value; the feature windows leave the target tokens to generate."""
    check_data_prompt(cfg.eagle, cfg.distill)
    if cfg.method.name != "eagle":
        raise ValueError(f"method.name: an eagle sweep evaluates method eagle with each "
                         f"trial's drafter, got {cfg.method.name!r}")
    ks = _swept(cfg, "eagle.hass_k", cfg.eagle.hass_k)
    swept = cfg.sweep.space.get("eagle.hass_k")
    if swept is not None and swept.randint:
        ks.append(swept.randint[1] - 1)
    widest = cfg.eagle.model_copy(update={"hass_k": max(ks)})  # the largest K swept
    for loss in swept_losses(cfg):
        objective_entry(loss, "eagle", "eagle.loss").check_job(widest, cfg)


def eagle_forward_time(dec, cfg: Any, prompt: list[int]) -> float:
    """Median seconds of one single-pair forward of an EAGLE drafter after ``prompt``
    (the cost model's ``t_draft`` for ``eagle``: weights do not change the time, so
    ``method.eagle_model`` when it is given, else a fresh ``eagle.layers`` drafter)."""
    source = getattr(cfg.method, "eagle_model", None)
    sweeping = cfg.sweep is not None and cfg.sweep.kind == "eagle"
    if not sweeping and source:
        model = load_eagle(resolve_source(source, "method.eagle_model"),
                           target=dec.target.model)
    else:  # the drafter eagle.* trains (EAGLE-1/2 or EAGLE-3), untrained
        model = build_eagle(trained_meta(dec.target.model.config, cfg.eagle))
    device, dtype = dec.target.device, dec.target.dtype
    runner = ModelRunner(model.to(device, dtype).eval())

    def pairs(tokens: list[int]) -> None:  # the target's features: k * H for EAGLE-3
        feats = torch.zeros(1, len(tokens), model.meta.feature_width, dtype=dtype,
                            device=device)
        runner.run(torch.tensor(tokens), features=feats)

    pairs(prompt[1:])
    return median_call_time(runner, lambda: pairs(prompt[-1:]))


def eagle_trial(config: dict, *, base: dict, target: str, draft: str | None, data_dir: str,
                prompts: list[list[int]], t_draft: float, t_target: float, vocab: int,
                eos: int | None, run_dir: str) -> None:
    """Tune function trainable for EAGLE-family drafter trials (see the module docstring).

    Ray Train runs in chunks of ``train.report_every`` steps, each resuming the last
    checkpoint of the same run; the drafter is then saved under
    ``<run_dir>/trials/eagle-<trial>/eagle`` and ``method`` (an ``eagle`` method) decodes
    the prompts with it: ``tau``, ``speedup`` and the cost-model ``predicted_speedup``
    (``t_draft``: one EAGLE drafter forward, measured once per sweep).
    """
    from ray import tune

    log_start(run_dir, config["params"], base)
    cfg = trial_config(base, config["params"])
    name = "eagle-" + tune.get_context().get_trial_id()

    def held_out(result, done: int) -> dict:
        metrics = {k: float(v) for k, v in result.metrics.items()
                   if k in ("val_loss", "val_top1", "engine_tau")}
        return {**metrics, "val_top1_miss": 1.0 - metrics["val_top1"],
                "step": int(result.metrics["step"])}

    result, metrics = train_in_chunks(
        cfg, cfg.train.steps, lambda train: EagleTaskConfig(train=train, eagle=cfg.eagle,
                                                            target=target),
        name, run_dir, data_dir, vocab, eos, held_out)
    folder = save_final_eagle(result, target, Path(run_dir) / "trials" / name)
    m = parse_method({**cfg.method.model_dump(exclude_none=True), "eagle_model": str(folder)})
    metrics.update(evaluate_method(cfg, target, draft, prompts, None, t_draft, t_target, m))
    metrics["objective"] = objective(metrics, base["sweep"])
    tune.report(metrics)

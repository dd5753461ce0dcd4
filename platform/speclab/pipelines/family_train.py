"""Stage: any trained drafter family, trained by name (``jobs.train_drafter``, and the
Tune hooks of a family whose training group is ``drafter``).

Nothing here names a family: everything comes from its declaration
(:class:`speclab.families.spec.TrainedFamily`), a built-in or one a module in
``$SPECLAB_PLUGINS`` registered.

1. **prepare** (:func:`prepare_family`): the family's ``prepare`` hook when it declares
   one, else :func:`~speclab.pipelines.signals.prepare_target` (target, tokenizer,
   corpus); ``output.export`` must name formats the family writes (``formats_out``).
2. **generate** (:func:`generate_family_data`): the data kinds the training group
   consumes (the family's ``data_kinds`` hook, else its objective's kind), on Ray actors
   with :func:`~speclab.pipelines.signals.generate_logged`. Kinds whose rows read a
   training group (EAGLE's data settings, TALF's trees) get the family's group.
3. **train, save, register, evaluate** (:func:`train_register_evaluate`): the family's
   Ray Train task (``task``, a config ``{"kind", "train", <train_group>, "target"}``)
   through :func:`~speclab.pipelines.fit.fit`, the artifact written by its ``save`` hook
   ``(result, target, run_dir) -> folder``, exported (``output.export``), logged and
   registered (``output.register_as``), then ``methods`` evaluated against plain
   decoding with the artifact in the family's ``artifact_field`` where it is
   ``trained``.

Tune (``sweep.kind`` of a family declaring these as its :class:`SweepSpec` hooks):
:func:`prepare_sweep`, :func:`generate_sweep` (the data of every swept value of the
training group's categorical knobs, once per sweep) and :func:`validate_sweep`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from speclab.families.objectives import objective
from speclab.families.registry import family, sweep_kinds
from speclab.families.spec import TrainedFamily
from speclab.pipelines.actor_eval import evaluate_trained, tokenized_prompts
from speclab.pipelines.export import export_final
from speclab.pipelines.fit import fit
from speclab.pipelines.signals import Prepared, generate_logged, prepare_target
from speclab.train.tasks import TaskConfigBase, parse_task_config

JOB = "train_drafter"


def family_group(cfg: Any, fam: TrainedFamily) -> Any:
    """The typed training group of ``fam`` in a job config: ``drafter`` of a
    ``train_drafter`` config (:meth:`TrainDrafterJob.drafter_config`), else the
    ``<train_group>`` group (a dict, e.g. a tune config's ``drafter``, is validated by the
    family's ``train_config`` class)."""
    typed = getattr(cfg, "drafter_config", None)
    if callable(typed):
        return typed()
    group = getattr(cfg, fam.train_group)
    return fam.train_config_class().model_validate(group) if isinstance(group, dict) else group


def family_kinds(fam: TrainedFamily, group: Any) -> set[str]:
    """The generated data kinds training ``fam`` with ``group`` consumes: its
    ``data_kinds`` hook, else the data kind of the objective ``group.loss`` names."""
    if fam.data_kinds:
        return set(fam.call("data_kinds", group))
    name = getattr(group, "loss", None)
    if not isinstance(name, str):
        raise ValueError(f"family {fam.name!r} declares no data_kinds and its training group "
                         "names no objective (loss): nothing says what data it trains on")
    return {objective(name, fam.name, f"{fam.train_group}.loss").kind_for(group)}


def prepare_family(cfg: Any) -> Prepared:
    """The inputs of ``cfg.family``'s training, checked on the driver before any work
    (ValueError naming the field)."""
    fam = family(cfg.family)
    bad = [f for f in cfg.output.export if f not in fam.formats_out]
    if bad:
        raise ValueError(f"output.export: family {fam.name!r} exports to "
                         f"{', '.join(fam.formats_out) or 'no public format'}, not "
                         f"{', '.join(bad)}")
    return fam.call("prepare", cfg) if fam.prepare else prepare_target(cfg)


def generate_family_data(cfg: Any, prep: Prepared, data_dir: Path, tracker,
                         fam: TrainedFamily, groups: list[Any], job: str = JOB) -> set[str]:
    """Stage 1: the shards of every data kind training ``fam`` with any of ``groups``
    consumes, on Ray actors (shards already there are kept). Returns the kinds."""
    group_of: dict[str, Any] = {}
    for group in groups:
        for kind in sorted(family_kinds(fam, group)):
            group_of.setdefault(kind, group)
    if prep.window:  # what the family's prepare measured of its trained window
        tracker.log_metrics(prep.window)
    generate_logged(cfg, prep, data_dir, tracker, set(group_of), job, group_of)
    return set(group_of)


def family_task(fam: TrainedFamily, train: Any, group: Any, target: str) -> TaskConfigBase:
    """``fam``'s Ray Train task config: ``train`` (a :class:`TrainConfig`), its training
    ``group`` and the ``target`` folder, validated by the task's registered config class."""
    return parse_task_config({"kind": fam.task, "train": train.model_dump(mode="json"),
                              fam.train_group: group.model_dump(mode="json"),
                              "target": str(target)})


def final_metrics(metrics: dict) -> dict[str, float]:
    """The last report's held-out figures as ``final_<name>`` (``val_*``, ``engine_*``)."""
    return {f"final_{k}": float(v) for k, v in metrics.items()
            if k.startswith(("val_", "engine_")) and isinstance(v, int | float)}


def train_register_evaluate(cfg: Any, prep: Prepared, storage: Path, run_name: str,
                            data_dir: Path, tracker, fam: TrainedFamily, group: Any,
                            evaluate: bool = True, job: str = JOB
                            ) -> tuple[Path, list[dict]]:
    """Stages 2-3: ``fam``'s task with ``group`` on Ray Train (``train``, ``scaling``),
    the artifact saved by the family's ``save`` hook under ``<storage>/<run_name>``,
    exported, logged and registered (``output.register_as``), then (``evaluate``)
    ``methods`` against plain decoding, with the artifact where the family's
    ``artifact_field`` is ``trained``. Returns (the artifact's folder, the rows, AR
    first)."""
    if fam.save is None:
        raise ValueError(f"family {fam.name!r} declares no 'save' hook: the generic stage "
                         "cannot write its artifact")
    task = family_task(fam, cfg.train, group, prep.target)
    t1 = time.perf_counter()
    result = fit(task, cfg.scaling, storage, run_name, data_dir, prep.vocab, prep.eos,
                 tracker.run_id, tracker.uri if tracker.run_id else None)
    final = Path(fam.call("save", result, prep.target, storage / run_name))
    export_final(cfg.output.export, final, prep.target, tracker, job)
    tracker.log_metrics({"train_s": time.perf_counter() - t1,
                         "final_step": result.metrics["step"],
                         **final_metrics(result.metrics)})
    uri = tracker.log_model(final, cfg.output.register_as)
    print(f"[{job}] {fam.name} artifact saved to {final}"
          + (f", registered as {uri}" if uri else ""), flush=True)
    if not evaluate or fam.artifact_field is None:
        return final, []
    rows = evaluate_trained(cfg, prep.target, tokenized_prompts(cfg, prep.target), tracker,
                            fam.artifact_field, str(final))
    return final, rows


# --- Tune: the hooks of a family swept by speclab.pipelines.tune_trials.family_trial ---

def _sweep_family(cfg: Any) -> TrainedFamily:
    return sweep_kinds()[cfg.sweep.kind]


def prepare_sweep(cfg: Any) -> tuple[Prepared, None]:
    """``SweepSpec.prepare``: the family's ``prepare`` hook, else the target and corpus
    (:func:`prepare_target`); no draft LM."""
    fam = _sweep_family(cfg)
    return (fam.call("prepare", cfg) if fam.prepare else prepare_target(cfg)), None


def swept_groups(cfg: Any, fam: TrainedFamily) -> list[Any]:
    """The training group and, for each grid / choice value of a swept
    ``<train_group>.<knob>``, the group with that value (values the group refuses are
    left to their trial, which fails naming the field)."""
    base = family_group(cfg, fam)
    groups = [base]
    for path, domain in cfg.sweep.space.items():
        head, _, knob = path.partition(".")
        if head != fam.train_group:
            continue
        for value in list(domain.grid or domain.choice or []):
            try:
                groups.append(type(base).model_validate({**base.model_dump(), knob: value}))
            except ValueError:
                continue
    return groups


def generate_sweep(cfg: Any, inputs: Any, sweep_dir: Path, tracker) -> None:
    """``SweepSpec.generate``: the data every trial's group trains on, once per sweep."""
    fam = _sweep_family(cfg)
    generate_family_data(cfg, inputs.train_prep, sweep_dir / "data", tracker, fam,
                         swept_groups(cfg, fam), "tune")


def validate_sweep(cfg: Any) -> None:
    """``SweepSpec.validate``: a sweep of a family's trials evaluates the family's method
    (with each trial's artifact); each swept objective's own job checks hold."""
    fam = _sweep_family(cfg)
    if fam.method is not None and cfg.method.name != fam.method:
        raise ValueError(f"method.name: a {cfg.sweep.kind} sweep evaluates method "
                         f"{fam.method} with each trial's {fam.name} artifact, got "
                         f"{cfg.method.name!r}")
    for group in swept_groups(cfg, fam):
        name = getattr(group, "loss", None)
        if isinstance(name, str):
            objective(name, fam.name, f"{fam.train_group}.loss").check_job(group, cfg)

"""What a trained drafter family declares: :class:`TrainedFamily` (and its Tune trial
kind, :class:`SweepSpec`).

A declaration is pure data, like SpecForge's per-algorithm ``providers.py``: names of
what the family needs and offers, and its builders as ``"module:attribute"`` strings
that are imported only when a generic layer calls them (:func:`load`). So the
catalogue (:mod:`speclab.families.registry`) imports no torch model, no Ray and no
trainer, and no generic layer imports a family module: the training jobs and stages,
``train/tasks``, the job prechecks, Tune's trial kinds, Serve's draft replica,
``speclab export`` and the CLI look a family up by name and call what it declares.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


def load(ref: str) -> Any:
    """The object a ``"package.module:attribute"`` reference names (imported now)."""
    module, _, attr = ref.partition(":")
    if not attr:
        raise ValueError(f"{ref!r}: a reference is 'package.module:attribute'")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class SweepSpec:
    """How Ray Tune sweeps a family (``tune`` with ``sweep.kind: <kind>``).

    * ``kind``: the ``sweep.kind`` value;
    * ``groups``: the config groups a sweep of this kind carries (beside the common ones);
    * ``heldout_metric``: what a trial reports after every chunk of training (ASHA
      minimises it);
    * ``prepare``: ``(cfg) -> (train_prep, draft)``: resolved and checked on the driver
      before Ray starts (ValueError on bad input);
    * ``generate``: ``(cfg, inputs, sweep_dir, tracker) -> None``: the data generated once
      per sweep, before any trial (None: none);
    * ``trial``: the Ray Tune trainable (``tune.with_parameters`` gets ``base``,
      ``target``, ``draft``, ``prompts``, ``t_draft``, ``t_target``, ``run_dir``,
      ``data_dir``, ``vocab``, ``eos``);
    * ``best``: ``(cfg, best_params, data, trial_dir, target, trial) -> (job, data)``: the
      best trial as a ready config of ``job`` (``evaluate`` by default, with the trial's
      own artifact in the method's field);
    * ``fixed_fields``: dotted fields the once-per-sweep data depends on (refused in
      ``sweep.space``, beside every ``distill.*``);
    * ``validate``: ``(cfg) -> None``: checks of a sweep config (ValueError);
    * ``steps``: ``(cfg) -> int``: training steps per trial (ASHA's rungs);
    * ``cpu_only``: trials run on the CPU whatever ``sweep.trial_gpus`` says;
    * ``times``: False when the sweep measures no forward costs (t_draft, t_target);
    * ``artifact``: where a trial's artifact lies under the sweep's ``trials`` folder
      (``{family}`` and ``{trial}`` filled in), for the best config.
    """

    kind: str
    groups: tuple[str, ...]
    heldout_metric: str
    trial: str
    prepare: str | None = None
    generate: str | None = None
    best: str | None = None
    fixed_fields: tuple[str, ...] = ()
    validate: str | None = None
    steps: str | None = None
    cpu_only: bool = False
    times: bool = True
    artifact: str = "{family}-{trial}/{family}"


@dataclass(frozen=True)
class TrainedFamily:
    """One trained drafter family: what its training needs and what it offers.

    * ``name``: the family (``eagle``, ``medusa``, ...);
    * ``method``: the decoding method a trained artifact feeds (None: the family trains
      a plain draft LM, used through ``models.draft``);
    * ``artifact_field``: the method's field a trained artifact fills (``eagle_model``):
      a job that trains the family sets it to ``trained`` by default, and evaluation,
      Serve and Tune's best config put the artifact's folder there;
    * ``task``: the Ray Train task kind (:func:`speclab.train.tasks.register_task`) and
      ``task_module``: the module that registers it (imported on first lookup);
    * ``train_group``: the config group holding the family's training knobs and
      ``train_config``: its class (``"module:Class"``);
    * ``objectives``: the names of its objectives in the objective registry
      (:mod:`speclab.families.objectives`);
    * ``data_kinds``: ``(train_group) -> set[str]``: the generated data kinds training
      consumes (:func:`speclab.train.distill_data.register_data_kind`);
    * ``prepare``: ``(cfg) -> Prepared``: the job's inputs checked before any work;
    * ``train``: ``(cfg, prep, storage, run_name, data_dir, tracker, register_as,
      evaluate) -> (artifact folder, evaluation rows)``: train, save, register, evaluate;
    * ``is_artifact``: ``(model) -> bool``: whether a loaded model is one of the
      family's artifacts; ``check_artifact``: ``(model, target_config, field,
      target_source, target_vocab) -> None``: a ValueError naming ``field`` when it was
      not trained for the target (Serve's draft replica checks at load with it; without
      the target's folder ``target_config`` and ``target_source`` are None and the
      vocabulary ``target_vocab`` is all there is to check);
    * ``formats_in`` / ``formats_out``: drafter formats it reads and writes
      (:mod:`speclab.models.formats`);
    * ``job``: its own training job (``jobs.<job>``; the generic ``train_drafter``
      trains every family that declares ``save``);
    * ``check_job``: ``(group, job_cfg) -> None``: checks of the training group against
      the job's other groups that hold for every objective (EAGLE's data windows);
    * ``save``: ``(result, target, run_dir) -> folder``: the artifact of a finished Ray
      Train run written under ``run_dir`` (the generic training stage and Tune trial);
    * ``draft_time``: ``(decoder, cfg, prompt) -> seconds``: one forward of the
      family's drafter, the cost model's ``t_draft`` when its method has no draft LM;
    * ``sweep``: its Tune trial kind (None: not swept by training trials).
    """

    name: str
    summary: str
    task: str
    task_module: str
    train_group: str
    train_config: str
    objectives: tuple[str, ...] = ()
    method: str | None = None
    artifact_field: str | None = None
    data_kinds: str | None = None
    prepare: str | None = None
    train: str | None = None
    is_artifact: str | None = None
    check_artifact: str | None = None
    formats_in: tuple[str, ...] = ()
    formats_out: tuple[str, ...] = ()
    job: str | None = None
    check_job: str | None = None
    save: str | None = None
    draft_time: str | None = None
    sweep: SweepSpec | None = None

    def call(self, hook: str, *args: Any, **kwargs: Any) -> Any:
        """Call the builder the declaration names under ``hook`` (``"prepare"``, ...)."""
        ref = getattr(self, hook)
        if ref is None:
            raise ValueError(f"family {self.name!r} declares no {hook!r}")
        return load(ref)(*args, **kwargs)

    def train_config_class(self) -> type:
        """The pydantic class of the family's training group."""
        return load(self.train_config)

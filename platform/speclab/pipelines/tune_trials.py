"""Stage: what Ray Tune trials that TRAIN something share (the tune job).

A training trial builds its Ray Train trainer inside the trial (the Ray Train V2
pattern) through :func:`speclab.pipelines.fit.fit`, in chunks of ``train.report_every``
steps (:func:`train_in_chunks`): each chunk resumes the last checkpoint of the same run,
and after each chunk a held-out figure is reported so ASHA can stop bad trials early.
The last report carries the sweep objective.

Each trained family declares its own trainable (:class:`speclab.families.spec.SweepSpec`,
``trial``): EAGLE's, the acceptance head's and AtSpeed's live in their family folders;
:func:`family_trial` trains any family whose task config takes ``train``, its training
group and ``target`` (a family from a plugin, e.g.), then decodes ``method`` with the
trial's artifact in the family's method field.

Every model a trial loads to score or decode (target, draft, the held-out drafter features,
the trained head or drafter) is in ``models.dtype`` on ``models.device``, which the tune
job sets to the trial's own device (:func:`speclab.sweep.trial_device`: ``cuda`` when the
trial reserved a GPU). Ray Train's workers inside a trial take their own resources
(``scaling``), not the trial's.
"""

from __future__ import annotations

from pathlib import Path

from speclab.config import TuneJob
from speclab.config.method import parse_method
from speclab.families.registry import sweep_kinds
from speclab.pipelines.family_train import family_group, family_task
from speclab.pipelines.fit import fit
from speclab.sweep import evaluate_method, log_start, objective, trial_config


def _chunks(steps: int, every: int) -> list[int]:
    """Step counts at which a chunked training trial reports: every, 2*every, ..., steps."""
    return [min(done, steps) for done in range(every, steps + every, every)]


def train_in_chunks(cfg: TuneJob, steps: int, make_task, name: str, run_dir: str,
                     data_dir: str, vocab: int, eos: int | None, held_out):
    """Ray Train for ``steps`` steps in chunks of ``train.report_every`` (each chunk
    resumes the last checkpoint of run ``name`` under ``<run_dir>/trials``).

    ``make_task(train)`` builds the task config for a chunk's ``train`` group;
    ``held_out(result, done) -> metrics`` scores it. Every chunk but the last is reported
    (ASHA may stop the trial there). Returns the last (result, metrics)."""
    from ray import tune

    for done in _chunks(steps, cfg.train.report_every):
        task = make_task(cfg.train.model_copy(update={"steps": done}))
        result = fit(task, cfg.scaling, Path(run_dir) / "trials", name, Path(data_dir), vocab,
                     eos, None, None)
        metrics = held_out(result, done)
        if done < steps:  # intermediate result: ASHA may stop the trial here
            tune.report(metrics)
    return result, metrics




def family_trial(config: dict, *, base: dict, target: str, draft: str | None, data_dir: str,
                 prompts: list[list[int]], t_draft: float, t_target: float, vocab: int,
                 eos: int | None, run_dir: str) -> None:
    """Tune function trainable for the trials of any family declaring a ``save`` hook
    (``sweep.kind`` names the family's sweep): its task (``train``, the trial's
    ``<train_group>`` group, ``target``) trains in chunks reporting ``val_loss`` (and
    every other numeric figure the task reports), the artifact is saved by the family's
    ``save`` hook under ``<run_dir>/trials/<family>-<trial>`` (where
    ``SweepSpec.artifact`` finds it for the best config) and ``method`` decodes the
    prompts with it in the family's method field: ``tau``, ``speedup``,
    ``predicted_speedup``, ``identical_to_ar``."""
    from ray import tune

    log_start(run_dir, config["params"], base)
    cfg = trial_config(base, config["params"])
    fam = sweep_kinds()[base["sweep"]["kind"]]
    if fam.save is None:
        raise ValueError(f"sweep.kind: family {fam.name!r} declares no 'save' hook, so "
                         "family_trial cannot write its trials' artifacts")
    group = family_group(cfg, fam)  # the trial's own values of the swept knobs
    name = f"{fam.name}-" + tune.get_context().get_trial_id()

    def held_out(result, done: int) -> dict:
        del done
        return {**{k: float(v) for k, v in result.metrics.items()
                   if isinstance(v, int | float) and not isinstance(v, bool)
                   and k != "step"},
                "step": int(result.metrics["step"])}

    result, metrics = train_in_chunks(cfg, cfg.train.steps,
                                      lambda train: family_task(fam, train, group, target),
                                      name, run_dir, data_dir, vocab, eos, held_out)
    folder = fam.call("save", result, target, Path(run_dir) / "trials" / name)
    m = parse_method({**cfg.method.model_dump(exclude_none=True),
                      fam.artifact_field: str(folder)})
    metrics.update(evaluate_method(cfg, target, draft, prompts, None, t_draft, t_target, m))
    metrics["objective"] = objective(metrics, base["sweep"])
    tune.report(metrics)

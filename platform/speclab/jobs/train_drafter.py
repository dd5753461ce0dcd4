"""Train any trained drafter family by name: the target's data on Ray actors, the
family's task on Ray Train, its artifact saved, registered in MLflow and evaluated.

    python -m jobs.train_drafter --config experiments/x.yaml [key=value ...]

``family`` names the family (a built-in, or one a module in ``$SPECLAB_PLUGINS``
registers, e.g. ``SPECLAB_PLUGINS=tests.plugins.mlp_speculator`` for ``family:
mlp_speculator``); ``drafter`` is its training group, validated by the class its
declaration names (unknown or bad knobs fail before any work, naming
``drafter.<knob>``). Stage 1, generate: the data kinds the group consumes (the
family's ``data_kinds``) as Parquet shards under ``<run>/data/<kind>`` (``distill``:
windows, top-k, actors; shards already there are kept). Stage 2, train: the family's
task (``train``, ``scaling``) with the same loop, checkpoints and FailureConfig as every
training job; rank 0 logs ``loss``, ``val_loss`` and the task's own held-out figures.
Then the family's ``save`` hook writes the artifact, which is logged and registered
(``output.register_as``) and evaluated: ``methods`` against plain decoding, where the
family's method defaults to the trained artifact (``<artifact field>: trained``).
(:mod:`speclab.pipelines.family_train`.)
"""

from __future__ import annotations

from speclab.families.registry import family
from speclab.pipelines.cli import run_dirs, start_job
from speclab.pipelines.family_train import (
    JOB,
    generate_family_data,
    prepare_family,
    train_register_evaluate,
)
from speclab.raylib import init_ray


def main(argv: list[str] | None = None) -> int:
    job = start_job(JOB, __doc__, argv, prepare_family)  # bad inputs fail here
    cfg, tracker, prep = job.cfg, job.tracker, job.inputs
    fam = family(cfg.family)
    group = cfg.drafter_config()

    storage, run_name = run_dirs(cfg)
    data_dir = storage / run_name / "data"
    where = init_ray(job.address, cfg.ray.num_cpus)
    print(f"[{JOB}] running on {where}; family {fam.name}; run dir {storage / run_name}",
          flush=True)
    with tracker as t:
        loss = getattr(group, "loss", None)
        t.set_tags({"job": JOB, "family": fam.name, "run_dir": str(storage / run_name),
                    "target": prep.target, **({"loss": loss} if isinstance(loss, str) else {})})
        generate_family_data(cfg, prep, data_dir, t, fam, [group])
        train_register_evaluate(cfg, prep, storage, run_name, data_dir, t, fam, group)
    return 0

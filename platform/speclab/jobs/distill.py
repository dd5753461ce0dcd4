"""Distil a drafter for a target: generate the target's signals on Ray actors, train the
drafter with Ray Train, register it in MLflow and evaluate it with the engine.

    python -m jobs.distill --config experiments/smoke/distill.yaml [key=value ...]

Stage 1, generate: the corpus (tokenised with the target's tokenizer) is cut into
deterministic windows; target replicas on Ray actors turn them into what the losses
need (``distill.loss``; see :mod:`speclab.train.distill_data`) and write Parquet shards
``<run>/data/<kind>/shard-NNNNN.parquet`` one at a time (written to a temporary name,
then renamed, so a shard is either whole or absent). Shards already present are not
regenerated, so a rerun with ``train.resume=true`` resumes generation too; a lost
generation actor's shards are generated again (see :mod:`speclab.pipelines.signals`).
Stage 2, train: a LLaMA drafter (``arch``, sharing the target's tokenizer) is trained on
the shards with Ray Train (same loop, checkpoints and FailureConfig as train_target).
Then the drafter is saved, registered (``output.register_as``) and evaluated against the
target (``methods``, ``data``, ``decoding``) in the same MLflow run (``eval/best_*``,
``eval_results.*``, the plots), each method a child run of it.

Resume: if the driver dies, ``train.resume=true output.run_name=X`` continues run X:
finished shards are kept, missing ones generated, and training continues from the
latest committed checkpoint (``[train] resumed from step N``, metric
``resumed_from_step``). An existing ``output.run_name`` without ``train.resume=true`` is
refused before any work.
"""

from __future__ import annotations

from speclab.config import DistillJob
from speclab.losses import loss_data_kinds
from speclab.pipelines.cli import run_dirs, start_job
from speclab.pipelines.drafter import prepare_drafter, train_register_evaluate
from speclab.pipelines.signals import Prepared, generate_logged
from speclab.raylib import init_ray


def prepare(cfg: DistillJob) -> Prepared:
    """:func:`~speclab.pipelines.drafter.prepare_drafter`, after refusing to reuse a
    named run without ``train.resume=true`` (Ray Train would silently continue its
    checkpoints)."""
    storage, run_name = run_dirs(cfg)
    if cfg.output.run_name and (storage / run_name).exists() and not cfg.train.resume:
        raise ValueError(f"output.run_name: {run_name!r} exists in {storage}; set "
                         "train.resume=true to continue it or choose another name")
    return prepare_drafter(cfg)


def main(argv: list[str] | None = None) -> int:
    job = start_job("distill", __doc__, argv, prepare)  # bad inputs fail here
    cfg, tracker, prep = job.cfg, job.tracker, job.inputs

    storage, run_name = run_dirs(cfg)
    data_dir = storage / run_name / "data"
    kinds = loss_data_kinds(cfg.distill.loss_weights())
    where = init_ray(job.address, cfg.ray.num_cpus)
    print(f"[distill] running on {where}; run dir {storage / run_name}", flush=True)
    with tracker as t:
        t.set_tags({"job": "distill", "run_dir": str(storage / run_name),
                    "target": prep.target, "loss": ",".join(sorted(cfg.distill.loss_weights()))})
        generate_logged(cfg, prep, data_dir, t, kinds, "distill")
        train_register_evaluate(cfg, prep, storage, run_name, data_dir, t,
                                cfg.output.register_as)
    return 0

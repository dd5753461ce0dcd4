"""Train an EAGLE feature drafter for a target: target features on Ray actors, the
drafter on Ray Train (EAGLE, HASS or TALF loss), MLflow registry, evaluation with the engine.

    python -m jobs.distill_eagle --config experiments/smoke/distill_eagle.yaml [key=value ...]

Stage 1, generate: deterministic corpus windows (``distill.examples`` x ``distill.seq_len``)
go to target replicas on Ray actors, which write ``feat`` Parquet shards (tokens, the
target's last-layer features as float16 bytes, its top-``distill.top_k``) under
``<run>/data/feat`` (bounded by ``distill.examples``; whole-or-absent shards, reused on
``train.resume=true``); ``eagle.loss=talf`` writes ``feat_tree`` shards, which add the
target's beam tree rooted at every position. Stage 2, train: an
:class:`~speclab.families.eagle.model.EagleModel` with the target's embedding and LM head copied
and frozen, ``eagle.layers`` trainable decoder layers (or the drafter in
``eagle.init_from``), the ``eagle.loss`` objective (:mod:`speclab.families.eagle.training`), on Ray
Train with the same loop, checkpoints and FailureConfig as every training job. At every
report rank 0 logs ``loss``, ``val_loss``, ``val_top1`` and the ENGINE's figures with the current
drafter (greedy EAGLE-2 decoding of ``eagle.engine_prompts`` held-out prompts:
``engine_tau``, ``engine_accept_at_<k>``, ``engine_speedup``) into the run, next to the loss.
Then the drafter is saved (``config.json`` naming its target + ``model.safetensors``),
registered (``output.register_as``) and evaluated: ``methods`` against plain decoding,
where ``eagle`` methods use the trained drafter.
"""

from __future__ import annotations

from speclab.families.eagle.stages import (
    data_kinds,
    generate_features,
    prepare_eagle,
    train_register_evaluate_eagle,
)
from speclab.pipelines.cli import run_dirs, start_job
from speclab.raylib import init_ray


def main(argv: list[str] | None = None) -> int:
    job = start_job("distill_eagle", __doc__, argv, prepare_eagle)  # bad inputs fail here
    cfg, tracker, prep = job.cfg, job.tracker, job.inputs

    storage, run_name = run_dirs(cfg)
    data_dir = storage / run_name / "data"
    where = init_ray(job.address, cfg.ray.num_cpus)
    print(f"[distill_eagle] running on {where}; run dir {storage / run_name}", flush=True)
    with tracker as t:
        t.set_tags({"job": "distill_eagle", "run_dir": str(storage / run_name),
                    "target": prep.target, "loss": cfg.eagle.loss})
        generate_features(cfg, prep, data_dir, t, data_kinds([cfg.eagle.loss],
                                                            cfg.eagle.version,
                                                            cfg.eagle.features))
        train_register_evaluate_eagle(cfg, prep, storage, run_name, data_dir, t,
                                      cfg.output.register_as)
    return 0

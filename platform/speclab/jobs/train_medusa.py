"""Train Medusa heads for a target: self-distillation data on Ray actors, MEDUSA-1 and/or
MEDUSA-2 on Ray Train, calibration (the sparse tree), MLflow registry, evaluation.

    python -m jobs.train_medusa --config experiments/smoke/train_medusa.yaml [key=value ...]

Stage 1, generate: deterministic corpus prompts (``distill.examples`` x
``distill.prompt_len``) go to target replicas on Ray actors, which continue each one
greedily for ``distill.response_len`` tokens and write ``medusa`` Parquet shards (the
sequence, the target's last-layer features as float16 bytes and its top-``distill.top_k``
at every position) under ``<run>/data/medusa`` (whole-or-absent shards, reused on
``train.resume=true``). Stage 2, for each of ``medusa.variants`` (an MLflow child run
each): ``medusa1`` trains ``medusa.heads`` heads on the stored features with the backbone
frozen; ``medusa2`` fine-tunes a copy of the target jointly with its heads (heads-only
warm-up, lower backbone learning rate) and writes the new target. Both use the same Ray
Train loop, checkpoints and FailureConfig as every training job; at every report rank 0
logs ``loss``, ``val_loss``, each head's held-out top-1 accuracy and the ENGINE's figures
with the heads as they are (``engine_tau``, ``engine_accept_at_<k>``,
``engine_speedup``). Then the heads' top-``medusa.calibration_top`` accuracies are
measured (``medusa.calibration``: held-out prompts of the evaluation's kind continued
greedily by the variant's target, or the held-out shard), the
``medusa.sparse_nodes``-node sparse tree is built
from them and stored with the heads (``tree.json``), the heads are registered
(``output.register_as``-<variant>) and ``methods`` are evaluated against plain decoding
of the variant's target. For ``medusa2`` the run also logs how far the new target moved
(``quality.ppl_original`` / ``quality.ppl_tuned`` on held-out text,
``quality.top1_agreement``, ``quality.greedy_token_agreement``,
``quality.repeat4_original`` / ``quality.repeat4_tuned``: how often each repeats itself).
The parent run gets the
variant x method table and plots.
"""

from __future__ import annotations

from speclab.families.medusa.stages import (
    group_kinds,
    prepare_medusa,
    train_register_evaluate_medusa,
)
from speclab.pipelines.cli import run_dirs, start_job
from speclab.pipelines.comparison import comparison_rows, log_comparison
from speclab.pipelines.signals import generate_logged
from speclab.raylib import init_ray


def main(argv: list[str] | None = None) -> int:
    job = start_job("train_medusa", __doc__, argv, prepare_medusa)  # bad inputs fail here
    cfg, tracker, prep = job.cfg, job.tracker, job.inputs

    storage, run_name = run_dirs(cfg)
    data_dir = storage / run_name / "data"
    where = init_ray(job.address, cfg.ray.num_cpus)
    print(f"[train_medusa] running on {where}; run dir {storage / run_name}", flush=True)
    table: list[dict] = []
    with tracker as parent:
        parent.set_tags({"job": "train_medusa", "run_dir": str(storage / run_name),
                         "target": prep.target})
        generate_logged(cfg, prep, data_dir, parent, group_kinds(cfg.medusa), "train_medusa")
        for variant in cfg.medusa.variants:
            register = (f"{cfg.output.register_as}-{variant}" if cfg.output.register_as
                        else None)
            print(f"[train_medusa] === {variant} ===", flush=True)
            with parent.child(f"{cfg.name}-{variant}", cfg.model_dump(mode="json")) as child:
                child.set_tags({"variant": variant})
                _, _, rows = train_register_evaluate_medusa(
                    cfg, prep, storage, f"{run_name}-{variant}", data_dir, child, variant,
                    register)
            table += comparison_rows(variant, rows, "variant")
        log_comparison(parent, table, "medusa_comparison", "variant")
    return 0

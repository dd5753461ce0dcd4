"""Train a SpecDec++ acceptance-prediction head for a drafter, register it in MLflow.

    python -m jobs.train_head --config experiments/smoke/train_head.yaml [key=value ...]

Driver: resolves the target and the drafter (folders or ``models:/`` URIs), checks
they share a vocabulary and loads the corpus. Stage 1 (Ray actors, as in
``jobs/distill.py``): for ``distill.examples`` corpus prompts, the target's response X,
the drafter's token Y_i at every position and its acceptance probability P_i, written
as ``accept`` Parquet shards (finished shards are kept on a rerun). Stage 2 (Ray
Train): the head (``head.depth``) on the frozen drafter's final hidden states over
mixed sequences (``head.mix_ratio`` of the tokens from X), weighted BCE with
``head.w_acc`` / ``head.w_rej``. Held-out loss, calibration (ECE) and accuracy are
logged; the output folder holds the drafter and ``acceptance_head.{json,safetensors}``
side by side and is registered as ``output.register_as``, so
``speclab generate --method specdecpp --draft URI --head URI`` uses it directly.
"""

from __future__ import annotations

from speclab.families.specdecpp.stages import prepare_head, train_head
from speclab.pipelines.cli import run_dirs, start_job
from speclab.raylib import init_ray


def main(argv: list[str] | None = None) -> int:
    job = start_job("train_head", __doc__, argv, prepare_head)  # bad inputs fail here, before Ray
    cfg, tracker, (prep, draft) = job.cfg, job.tracker, job.inputs

    storage, run_name = run_dirs(cfg)
    where = init_ray(job.address, cfg.ray.num_cpus)
    print(f"[train_head] running on {where}; run dir {storage / run_name}", flush=True)
    with tracker as t:
        t.set_tags({"job": "train_head", "run_dir": str(storage / run_name),
                    "target": prep.target, "draft": draft})
        train_head(cfg, prep, draft, storage, run_name, t, cfg.output.register_as)
    return 0

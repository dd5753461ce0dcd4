"""Train a LLaMA-architecture generative recommender (AtSpeed target) with Ray Train.

    python -m jobs.train_recommender --config experiments/smoke/train_recommender.yaml

Driver: builds the interactions (``rec``: synthetic, Amazon JSON lines or MovieLens),
semantic ids (residual k-means, collisions resolved), the word-level tokenizer of id
tokens and "history -> next item" examples from the chronological 8:1:1 split, into
``<storage>/<run>/data``. Ray Train then optimises L_Rec (eq. 37) with the same loop,
checkpoints and failure handling as the other training jobs. The model is saved with
its tokenizer and ``rec_meta.json`` (item ids <-> tokens) and registered in MLflow.
The same job trains an SFT drafter when given a smaller ``arch``.
"""

from __future__ import annotations

from speclab.pipelines.cli import run_dirs, start_job
from speclab.pipelines.recommender import prepare_rec, train_model
from speclab.raylib import init_ray
from speclab.train.tasks import RecTaskConfig


def main(argv: list[str] | None = None) -> int:
    job = start_job("train_recommender", __doc__, argv, prepare_rec)
    cfg, tracker, (meta, examples) = job.cfg, job.tracker, job.inputs

    storage, run_name = run_dirs(cfg)
    where = init_ray(job.address, cfg.ray.num_cpus)
    print(f"[train_recommender] running on {where}; {len(meta.items)} items, "
          f"{ {k: len(v) for k, v in examples.items()} } examples", flush=True)
    with tracker as t:
        t.set_tags({"job": "train_recommender", "run_dir": str(storage / run_name)})
        t.log_metrics({"items": len(meta.items), "train_examples": len(examples["train"]),
                       "test_examples": len(examples["test"])})
        train_model(RecTaskConfig(train=cfg.train, arch=cfg.arch), cfg.scaling, meta,
                    examples, storage, run_name, t, cfg.output.register_as)
    return 0

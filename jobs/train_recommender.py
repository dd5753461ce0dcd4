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

import json
import sys
from dataclasses import asdict
from pathlib import Path

import jobs  # noqa: F401  (makes speclab importable from a plain checkout)
from jobs._cli import start_job
from speclab.config import ExperimentConfig


def prepare(cfg: ExperimentConfig):
    """(RecMeta, examples per split) for the ``rec`` group; ValueError on bad input."""
    from speclab.data.rec_dataset import prepare_rec_data

    r = cfg.rec
    meta, examples = prepare_rec_data(r.source, r.path, r.users, r.items, r.dim, r.levels,
                                      r.codebook, r.history, r.seed)
    if not examples["train"]:
        raise ValueError("rec: no training examples (too few interactions per user)")
    return meta, examples


def write_data(meta, examples, data_dir: Path, extra: dict | None = None) -> Path:
    """The folder the ``rec`` / ``rec_align`` training tasks read: ``rec_meta.json``,
    the id tokenizer, ``examples.json`` and ``extra`` files (saved with torch.save)."""
    import torch

    from speclab.data.rec_dataset import save_rec_tokenizer

    data_dir.mkdir(parents=True, exist_ok=True)
    meta.save(data_dir)
    save_rec_tokenizer(meta, data_dir / "tokenizer")
    (data_dir / "examples.json").write_text(json.dumps(
        {k: [asdict(e) for e in v] for k, v in examples.items()}))
    for name, obj in (extra or {}).items():
        torch.save(obj, data_dir / name)
    return data_dir


def train_model(cfg: ExperimentConfig, meta, examples, storage: Path, run_name: str,
                tracker, register_as: str | None, task: str = "rec",
                extra: dict | None = None) -> Path:
    """Write the data folder (+ ``extra`` files saved with torch.save), train ``task``
    with Ray Train, save the model (+ rec_meta.json) and register it."""
    from jobs._train import fit, save_final
    from speclab.data.rec_dataset import EOS

    data_dir = write_data(meta, examples, storage / run_name / "data", extra)
    result = fit(task, cfg, storage, run_name, data_dir, meta.vocab_size, EOS,
                 tracker.run_id, tracker.uri if tracker.run_id else None)
    final = save_final(result, cfg, storage / run_name, data_dir / "tokenizer",
                       meta.vocab_size, EOS)
    meta.save(final)
    tracker.log_metrics({"final_step": result.metrics["step"],
                         "final_val_loss": result.metrics["val_loss"]})
    uri = tracker.log_model(final, register_as)
    print(f"[rec] model saved to {final}" + (f", registered as {uri}" if uri else ""),
          flush=True)
    return final


def main(argv: list[str] | None = None) -> int:
    job = start_job(__doc__, argv, prepare)
    cfg, tracker, (meta, examples) = job.cfg, job.tracker, job.inputs

    from jobs._cli import run_dirs
    from speclab.raylib import init_ray

    storage, run_name = run_dirs(cfg)
    where = init_ray(job.address, cfg.ray.num_cpus)
    print(f"[train_recommender] running on {where}; {len(meta.items)} items, "
          f"{ {k: len(v) for k, v in examples.items()} } examples", flush=True)
    with tracker as t:
        t.set_tags({"job": "train_recommender", "run_dir": str(storage / run_name)})
        t.log_metrics({"items": len(meta.items), "train_examples": len(examples["train"]),
                       "test_examples": len(examples["test"])})
        train_model(cfg, meta, examples, storage, run_name, t, cfg.output.register_as)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Stage: AtSpeed recommendation data and recommender training (train_recommender,
recommend_eval, tune).

:func:`prepare_rec` builds the interactions, semantic ids and "history -> next item"
examples of the ``rec`` group; :func:`write_data` writes the folder the ``rec`` /
``rec_align`` training tasks read; :func:`train_model` trains one task with Ray Train,
saves the model with ``rec_meta.json`` and registers it.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from speclab.config.schema import TrainScalingConfig
from speclab.data.rec_dataset import EOS, prepare_rec_data, save_rec_tokenizer
from speclab.pipelines.fit import fit, save_final


def prepare_rec(cfg: Any):
    """(RecMeta, examples per split) for the ``rec`` group of ``cfg``; ValueError on bad
    input."""
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

    data_dir.mkdir(parents=True, exist_ok=True)
    meta.save(data_dir)
    save_rec_tokenizer(meta, data_dir / "tokenizer")
    (data_dir / "examples.json").write_text(json.dumps(
        {k: [asdict(e) for e in v] for k, v in examples.items()}))
    for name, obj in (extra or {}).items():
        torch.save(obj, data_dir / name)
    return data_dir


def train_model(task, scaling: TrainScalingConfig, meta, examples, storage: Path,
                run_name: str, tracker, register_as: str | None,
                extra: dict | None = None) -> Path:
    """Write the data folder (+ ``extra`` files saved with torch.save), train ``task`` (a
    ``RecTaskConfig`` / ``RecAlignTaskConfig``) with Ray Train on ``scaling`` workers,
    save the model (+ rec_meta.json) and register it."""
    data_dir = write_data(meta, examples, storage / run_name / "data", extra)
    result = fit(task, scaling, storage, run_name, data_dir, meta.vocab_size, EOS,
                 tracker.run_id, tracker.uri if tracker.run_id else None)
    final = save_final(result, task.arch, storage / run_name, data_dir / "tokenizer",
                       meta.vocab_size, EOS)
    meta.save(final)
    tracker.log_metrics({"final_step": result.metrics["step"],
                         "final_val_loss": result.metrics["val_loss"]})
    uri = tracker.log_model(final, register_as)
    print(f"[rec] model saved to {final}" + (f", registered as {uri}" if uri else ""),
          flush=True)
    return final

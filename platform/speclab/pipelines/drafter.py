"""Stage: train a drafter on generated signals with Ray Train, register it in MLflow and
evaluate it against its target (distill, compare_losses)."""

from __future__ import annotations

import time
from pathlib import Path

from speclab.config import DistillJob
from speclab.config.schema import DraftArchConfig
from speclab.losses import loss_data_kinds
from speclab.models.loading import resolve_source
from speclab.models.pruned import check_cut
from speclab.pipelines.actor_eval import evaluate_pair, tokenized_prompts
from speclab.pipelines.fit import fit, save_final
from speclab.pipelines.signals import Prepared, check_shards, prepare_target
from speclab.train.tasks import DistillTaskConfig


def drafter_arch(cfg: DistillJob, prep: Prepared) -> DraftArchConfig:
    """``cfg.arch`` with ``init_from`` resolved to a local folder (``target``: the job's
    target; ``models:/`` URIs downloaded) and the cut checked against the target's
    vocabulary (:func:`speclab.models.pruned.check_cut`; ValueError naming
    ``arch.init_from``). Cheap (configs only): jobs call it before generating."""
    arch = cfg.arch
    if arch.init_from is None:
        return arch
    source = prep.target if arch.init_from == "target" else resolve_source(
        arch.init_from, "arch.init_from")
    check_cut(source, arch.layers, prep.vocab)
    return arch.model_copy(update={"init_from": source})


def prepare_drafter(cfg: DistillJob) -> Prepared:
    """:func:`~speclab.pipelines.signals.prepare_target` with ``arch.init_from`` checked
    (:func:`drafter_arch`), so a cut that cannot work fails before any generation."""
    prep = prepare_target(cfg)
    drafter_arch(cfg, prep)
    return prep


def train_register_evaluate(cfg: DistillJob, prep: Prepared, storage: Path, run_name: str,
                            data_dir: Path, tracker, register_as: str | None,
                            weights: dict[str, float] | None = None) -> list[dict]:
    """Train a drafter (``arch``, ``train``, ``scaling``) with the loss mix ``weights``
    (default ``distill.loss_weights()``), save and register it, then evaluate ``methods``
    against the target into ``tracker``'s run; returns the evaluation rows.

    Before training, the shards of every kind the loss mix reads are checked
    (:func:`~speclab.pipelines.signals.check_shards`): exactly shards ``0..n-1`` with
    ``distill.examples`` rows in all, so every example is trained on exactly once."""
    weights = weights or cfg.distill.loss_weights()
    check_shards(data_dir, loss_data_kinds(weights), cfg.distill)
    arch = drafter_arch(cfg, prep)
    task = DistillTaskConfig(train=cfg.train, arch=arch, hass_k=cfg.distill.hass_k,
                             weights=weights)
    t1 = time.perf_counter()
    result = fit(task, cfg.scaling, storage, run_name, data_dir, prep.vocab, prep.eos,
                 tracker.run_id, tracker.uri if tracker.run_id else None)
    prep.tokenizer.save_pretrained(data_dir / "tokenizer")
    final = save_final(result, arch, storage / run_name, data_dir / "tokenizer",
                       prep.vocab, prep.eos)
    tracker.log_metrics({"train_s": time.perf_counter() - t1,
                         "final_step": result.metrics["step"],
                         "final_val_loss": result.metrics["val_loss"]})
    uri = tracker.log_model(final, register_as)
    print(f"[distill] drafter saved to {final}" + (f", registered as {uri}" if uri else ""),
          flush=True)
    return evaluate_pair(cfg, prep.target, str(final), tokenized_prompts(cfg, prep.target),
                         tracker, "eval/")

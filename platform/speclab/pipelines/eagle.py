"""Stage: an EAGLE feature drafter trained on Ray Train from the target's features, saved,
registered and evaluated (distill_eagle, compare_eagle)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from speclab.pipelines.signals import Prepared, generate_logged, prepare_target


def prepare_eagle(cfg: Any) -> Prepared:
    """:func:`prepare_target`, then ``eagle.init_from`` resolved to a local folder (a
    ``models:/`` URI is downloaded) and checked against the target; ``cfg.eagle.init_from``
    is set to that folder (ValueError when it is not a drafter for this target). The
    formats of ``output.export`` are checked to hold the drafter the job will train."""
    prep = prepare_target(cfg)
    if cfg.output.export:  # before any work: a format that cannot hold the drafter
        from transformers import AutoConfig

        from speclab.models.eagle import EagleMeta
        from speclab.models.formats import check_exports

        config = AutoConfig.from_pretrained(prep.target, trust_remote_code=False)
        check_exports(cfg.output.export, EagleMeta.for_target(
            config, cfg.eagle.layers, cfg.eagle.norms, cfg.eagle.norms))
    if cfg.eagle.init_from:
        from speclab.models.eagle import load_init
        from speclab.models.loading import load_model, resolve_source

        folder = resolve_source(cfg.eagle.init_from, "eagle.init_from")
        load_init(folder, load_model(prep.target, field="models.target").config,
                  cfg.eagle.layers, norms=cfg.eagle.norms)
        cfg.eagle.init_from = str(folder)
    return prep


def data_kinds(losses: list[str]) -> set[str]:
    """The generated example kinds the EAGLE-family ``losses`` train on."""
    return {"feat_tree" if loss == "talf" else "feat" for loss in losses}


def save_final_eagle(result, target: str, layers: int, run_dir) -> Path:
    """The last checkpoint's drafter written with :func:`~speclab.models.eagle.save_eagle`
    to ``run_dir/eagle`` (its layout, speclab's or EAGLE-1/2's, read off the state)."""
    import torch

    from speclab.models.eagle import EagleModel, save_eagle
    from speclab.models.loading import load_model

    with result.checkpoint.as_directory() as d:
        state = torch.load(Path(d) / "state.pt", weights_only=False, map_location="cpu")
    model = EagleModel.from_target(
        load_model(target, field="models.target"), layers,
        input_norm="decoder.layers.0.input_layernorm.weight" in state["model"],
        final_norm="decoder.norm.weight" in state["model"]).float()
    model.load_state_dict(state["model"])
    return save_eagle(model, Path(run_dir) / "eagle")


def train_register_evaluate_eagle(cfg: Any, prep: Prepared, storage: Path, run_name: str,
                                  data_dir: Path, tracker, register_as: str | None,
                                  evaluate: bool = True) -> tuple[Path, list[dict]]:
    """Train an EAGLE drafter (``cfg.eagle``, ``train``, ``scaling``) on Ray Train, save
    it, export it (``output.export``) and register it, then (``evaluate``) run
    ``methods`` against the target, ``eagle`` methods with ``eagle_model: trained`` using
    this drafter. Returns (the drafter's folder, the evaluation rows, AR first)."""
    from speclab.pipelines.actor_eval import evaluate_trained, tokenized_prompts
    from speclab.pipelines.export import export_final
    from speclab.pipelines.fit import fit
    from speclab.train.tasks import EagleTaskConfig

    task = EagleTaskConfig(train=cfg.train, eagle=cfg.eagle, target=prep.target)
    t1 = time.perf_counter()
    result = fit(task, cfg.scaling, storage, run_name, data_dir, prep.vocab, prep.eos,
                 tracker.run_id, tracker.uri if tracker.run_id else None)
    final = save_final_eagle(result, prep.target, cfg.eagle.layers, storage / run_name)
    export_final(cfg.output.export, final, prep.target, tracker, "distill_eagle")
    tracker.log_metrics({"train_s": time.perf_counter() - t1,
                         "final_step": result.metrics["step"],
                         "final_val_loss": result.metrics["val_loss"],
                         "final_val_top1": result.metrics["val_top1"],
                         "final_engine_tau": result.metrics.get("engine_tau", 0.0)})
    uri = tracker.log_model(final, register_as)
    print(f"[distill_eagle] drafter saved to {final}"
          + (f", registered as {uri}" if uri else ""), flush=True)
    if not evaluate:
        return final, []
    rows = evaluate_trained(cfg, prep.target, tokenized_prompts(cfg, prep.target), tracker,
                            "eagle_model", str(final))
    return final, rows


def generate_features(cfg: Any, prep: Prepared, data_dir: Path, tracker,
                      losses: list[str]) -> None:
    """Stage 1: the ``feat`` / ``feat_tree`` shards ``losses`` need, on Ray actors."""
    generate_logged(cfg, prep, data_dir, tracker, data_kinds(losses), "distill_eagle")

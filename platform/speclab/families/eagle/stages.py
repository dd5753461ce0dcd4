"""Stage: an EAGLE feature drafter trained on Ray Train from the target's features, saved,
registered and evaluated (distill_eagle, compare_eagle)."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from speclab.families.objectives import objective
from speclab.pipelines.signals import Prepared, generate_logged, prepare_target


def prepare_eagle(cfg: Any) -> Prepared:
    """:func:`prepare_target`, then ``eagle.init_from`` resolved to a local folder (a
    ``models:/`` URI is downloaded) and checked against the target; ``cfg.eagle.init_from``
    is set to that folder (ValueError when it is not a drafter for this target). The
    formats of ``output.export`` are checked to hold the drafter the job will train."""
    from transformers import AutoConfig

    from speclab.families.eagle.model import trained_meta

    prep = prepare_target(cfg)
    config = AutoConfig.from_pretrained(prep.target, trust_remote_code=False)
    # before any work: the drafter eagle.* asks for must fit the target (EAGLE-3's
    # feature layers and draft vocabulary), for each compared row too
    eagles = ([cfg.compare.row_eagle(row, cfg.eagle) for row in cfg.compare.losses]
              if hasattr(cfg, "compare") else [cfg.eagle])
    metas = [trained_meta(config, e) for e in eagles]
    from speclab.families.eagle.model import load_init
    from speclab.models.loading import resolve_source

    for name, source in getattr(getattr(cfg, "compare", None), "bases", {}).items():
        field = f"compare.bases.{name}"  # a given base: a drafter of the row's shape
        load_init(resolve_source(source, field), config, cfg.compare.row_eagle(name, cfg.eagle),
                  field)
    if cfg.output.export:  # a format that cannot hold the drafter
        from speclab.models.formats import check_exports

        for meta in metas:
            check_exports(cfg.output.export, meta, target_config=config)
    if cfg.eagle.init_from:
        folder = resolve_source(cfg.eagle.init_from, "eagle.init_from")
        load_init(folder, config, cfg.eagle)
        cfg.eagle.init_from = str(folder)
    prep.window = context_window(cfg, prep.tokenizer)
    return prep


def context_window(cfg: Any, tokenizer) -> dict[str, int]:
    """The EAGLE drafter's trained window against the contexts its evaluation decodes:
    ``trained_window`` (the tokens of one training window, ``distill.seq_len + 1``) and
    ``eval_longest_context`` (the longest ``data`` prompt, tokenised, plus
    ``decoding.max_new_tokens``). The drafter attends over the whole context, and a window
    teaches it only distances below the window; past it, it drafts at distances it never
    trained on and acceptance falls (decoding stays lossless). On the reference target
    with the stdlib prompts (74-169 tokens), an EAGLE-3 drafter trained on 65-token
    windows reached tau 2.54 under the EAGLE-2 tree 2/6/10, one trained on 257-token
    windows 3.15. Prints a warning naming both fields when the evaluation goes past the
    window."""
    from speclab.pipelines.actor_eval import tokenized_prompts

    prompts = tokenized_prompts(cfg, tokenizer=tokenizer)
    longest = max(map(len, prompts), default=0) + cfg.decoding.max_new_tokens
    window = cfg.distill.seq_len + 1
    if longest > window:
        print(f"[warning] distill.seq_len: the drafter trains on windows of {window} tokens, "
              f"but the evaluation decodes contexts of up to {longest} (the longest data "
              f"prompt + decoding.max_new_tokens {cfg.decoding.max_new_tokens}): past the "
              "window it drafts at distances it never trained on, and acceptance falls. "
              f"Set distill.seq_len to at least {longest - 1}.", flush=True)
    return {"trained_window": window, "eval_longest_context": longest}


def data_kind_of(loss: str, version: int = 1, features: str = "offline") -> str:
    """The generated example kind an EAGLE-family objective ``loss`` trains on with an
    EAGLE-1/2 (``version`` 1) or EAGLE-3 drafter (its objective entry's data kind:
    ``feat`` / ``feat3``, TALF's ``*_tree`` with the target-built trees; ``windows``
    with ``features: online``)."""
    return objective(loss, "eagle", "eagle.loss").kind_for(
        SimpleNamespace(version=version, features=features))


def data_kinds(losses: list[str], version: int = 1, features: str = "offline") -> set[str]:
    """The generated example kinds the EAGLE-family ``losses`` train on
    (:func:`data_kind_of`)."""
    return {data_kind_of(loss, version, features) for loss in losses}


def group_kinds(group: Any) -> set[str]:
    """The data kinds the ``eagle`` group trains on (the family's ``data_kinds``)."""
    return data_kinds([group.loss], group.version, group.features)


def save_final_eagle(result, target: str, run_dir) -> Path:
    """The last checkpoint's drafter written with :func:`~speclab.families.eagle.model.save_eagle`
    to ``run_dir/eagle`` (the checkpoint stores the drafter's meta)."""
    import torch

    from speclab.families.eagle.model import build_eagle, meta_from_dict, save_eagle

    with result.checkpoint.as_directory() as d:
        state = torch.load(Path(d) / "state.pt", weights_only=False, map_location="cpu")
    meta = state.get("meta")
    if meta is None:  # a checkpoint written before the meta was stored: EAGLE-1/2
        from speclab.families.eagle.model import EagleModel
        from speclab.models.loading import load_model

        model = EagleModel.from_target(
            load_model(target, field="models.target"),
            1 + max(int(k.split(".")[2]) for k in state["model"] if k.startswith(
                "decoder.layers.")),
            input_norm="decoder.layers.0.input_layernorm.weight" in state["model"],
            final_norm="decoder.norm.weight" in state["model"]).float()
    else:
        model = build_eagle(meta_from_dict(meta)).float()
    model.load_state_dict(state["model"])
    return save_eagle(model, Path(run_dir) / "eagle")


def train_register_evaluate_eagle(cfg: Any, prep: Prepared, storage: Path, run_name: str,
                                  data_dir: Path, tracker, register_as: str | None,
                                  evaluate: bool = True) -> tuple[Path, list[dict]]:
    """Train an EAGLE drafter (``cfg.eagle``, ``train``, ``scaling``) on Ray Train, save
    it, export it (``output.export``) and register it, then (``evaluate``) run
    ``methods`` against the target, ``eagle`` methods with ``eagle_model: trained`` using
    this drafter. Returns (the drafter's folder, the evaluation rows, AR first)."""
    from speclab.families.eagle.task import EagleTaskConfig
    from speclab.pipelines.actor_eval import evaluate_trained, tokenized_prompts
    from speclab.pipelines.export import export_final
    from speclab.pipelines.fit import fit

    task = EagleTaskConfig(train=cfg.train, eagle=cfg.eagle, target=prep.target)
    t1 = time.perf_counter()
    result = fit(task, cfg.scaling, storage, run_name, data_dir, prep.vocab, prep.eos,
                 tracker.run_id, tracker.uri if tracker.run_id else None)
    final = save_final_eagle(result, prep.target, storage / run_name)
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
                      kinds: set[str], eagles: dict[str, Any] | None = None) -> None:
    """Stage 1: the ``feat`` / ``feat_tree`` / ``feat3`` / ``feat3_tree`` shards (``kinds``,
    from :func:`data_kinds`), on Ray actors; ``eagles``: the ``eagle`` group of a kind
    whose rows are not made with ``cfg.eagle``."""
    tracker.log_metrics(prep.window)
    generate_logged(cfg, prep, data_dir, tracker, kinds, "distill_eagle", eagles)

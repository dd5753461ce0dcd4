"""Stage: SpecDec++ acceptance heads (train_head, specdecpp_eval, tune).

:func:`prepare_head` resolves the target and drafter and loads the corpus;
:func:`train_head` generates ``accept`` data on Ray actors (:mod:`.signals`), trains the
head on the frozen drafter with Ray Train (a ``HeadTaskConfig``: the drafter folder is
an argument, not a rewritten ``models.draft``), saves it next to the drafter, logs
held-out metrics (:func:`held_out_metrics`) and registers the folder.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from speclab.config.schema import HeadConfig
from speclab.pipelines.signals import Prepared, prepare_target


def prepare_head(cfg: Any) -> tuple[Prepared, str]:
    """(Prepared target + corpus, the drafter's local folder) for a config with
    ``models``, ``tokenizer`` and ``corpus`` groups; ValueError on bad input."""
    from speclab.models.loading import check_same_vocab, load_model, resolve_source
    from speclab.models.registry import resolve_models

    _, draft = resolve_models(cfg.models.target, cfg.models.draft)  # "tiny"/"reference" pairs
    if not draft:
        raise ValueError("models.draft: the acceptance head needs a drafter")
    prep = prepare_target(cfg)
    draft = resolve_source(draft, "models.draft")
    check_same_vocab(load_model(prep.target, field="models.target"),
                     load_model(draft, field="models.draft"))
    return prep, draft


def held_out_metrics(h: HeadConfig, head, draft: str, data_dir: Path, dtype: str = "float32",
                     device: str = "cpu") -> dict:
    """Loss (BCE weighted by ``h.w_acc`` / ``h.w_rej``), ECE and accuracy of ``head``
    on the held-out (last) ``accept`` shard, with ``h.mix_ratio``; the drafter's features
    come from ``draft`` loaded in ``dtype`` on ``device`` (where ``head`` is moved)."""
    import pyarrow.parquet as pq
    import torch

    from speclab.families.specdecpp.training import DraftFeatures, head_metrics, mixed_batch
    from speclab.losses import weighted_bce
    from speclab.models.loading import load_model

    rows = pq.read_table(sorted((data_dir / "accept").glob("shard-*.parquet"))[-1]).to_pylist()
    feats = DraftFeatures(load_model(draft, dtype, device, field="models.draft"))
    dev = feats.model.device
    b = mixed_batch(rows, feats, h.mix_ratio, torch.Generator().manual_seed(0), dev)
    with torch.no_grad():
        logits = head.to(dev)(b["hidden"])
    out = head_metrics(torch.sigmoid(logits)[b["mask"]], b["p"][b["mask"]])
    out["bce"] = float(weighted_bce(logits, b["p"], b["mask"], h.w_acc, h.w_rej))
    return {f"heldout_{k}": v for k, v in out.items()}


def train_head(cfg: Any, prep: Prepared, draft: str, storage: Path, run_name: str,
               tracker, register_as: str | None, data_dir: Path | None = None,
               head_cfg: HeadConfig | None = None) -> Path:
    """Generate (into ``data_dir``, default ``<run>/data``; finished shards are reused),
    train a head (``head_cfg``, default ``cfg.head``) on the frozen ``draft``, save it
    next to the drafter, log and register; returns the folder. ``cfg``: a train_head or
    specdecpp_eval config (``distill``, ``train``, ``scaling`` groups)."""
    import torch

    from speclab.decoding.acceptance_head import AcceptanceHead, save_head
    from speclab.families.specdecpp.task import HeadTaskConfig
    from speclab.pipelines.fit import fit
    from speclab.pipelines.signals import generate

    h = head_cfg or cfg.head
    data_dir = data_dir or storage / run_name / "data"
    t0 = time.perf_counter()
    shards, peak = generate(cfg, prep.target, data_dir, {"accept"}, prep.tokens, draft,
                            h.temperature)
    tracker.log_metrics({"generate_s": time.perf_counter() - t0, "shards": shards["accept"],
                         "generate_actor_peak_rss_mb": peak})
    task = HeadTaskConfig(train=cfg.train, head=h, draft=draft)
    t1 = time.perf_counter()
    result = fit(task, cfg.scaling, storage, run_name, data_dir, prep.vocab, prep.eos,
                 tracker.run_id, tracker.uri if tracker.run_id else None)
    with result.checkpoint.as_directory() as d:
        state = torch.load(Path(d) / "state.pt", weights_only=False, map_location="cpu")["model"]
    head = AcceptanceHead(state["out.weight"].shape[1], h.depth)
    head.load_state_dict(state)
    final = storage / run_name / "model"
    if final.exists():
        shutil.rmtree(final)
    shutil.copytree(draft, final, ignore=shutil.ignore_patterns("acceptance_head.*"))
    save_head(head, final, {"w_acc": h.w_acc, "w_rej": h.w_rej, "mix_ratio": h.mix_ratio,
                            "temperature": h.temperature, "target": prep.target})
    metrics = held_out_metrics(h, head.eval(), draft, data_dir)
    tracker.log_metrics({"train_s": time.perf_counter() - t1,
                         "final_step": result.metrics["step"],
                         "final_val_loss": result.metrics["val_loss"], **metrics})
    print("[train_head] held-out: " + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()),
          flush=True)
    uri = tracker.log_model(final, register_as)
    print(f"[train_head] drafter + head saved to {final}"
          + (f", registered as {uri}" if uri else ""), flush=True)
    return final

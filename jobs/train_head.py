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

import shutil
import sys
import time
from pathlib import Path

import jobs  # noqa: F401  (makes speclab importable from a plain checkout)
from jobs._cli import run_dirs, start_job
from speclab.config import ExperimentConfig


def prepare(cfg: ExperimentConfig):
    """(distill's Prepared for the target + corpus, the drafter's local folder)."""
    from jobs.distill import prepare as prepare_target
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


def held_out_metrics(cfg: ExperimentConfig, head, draft: str, data_dir: Path) -> dict:
    """Loss, ECE and accuracy of ``head`` on the held-out (last) ``accept`` shard."""
    import pyarrow.parquet as pq
    import torch

    from speclab.losses import weighted_bce
    from speclab.models.loading import load_model
    from speclab.train.head import DraftFeatures, head_metrics, mixed_batch

    rows = pq.read_table(sorted((data_dir / "accept").glob("shard-*.parquet"))[-1]).to_pylist()
    feats = DraftFeatures(load_model(draft, field="models.draft"))
    b = mixed_batch(rows, feats, cfg.head.mix_ratio, torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = head(b["hidden"])
    h = cfg.head
    out = head_metrics(torch.sigmoid(logits)[b["mask"]], b["p"][b["mask"]])
    out["bce"] = float(weighted_bce(logits, b["p"], b["mask"], h.w_acc, h.w_rej))
    return {f"heldout_{k}": v for k, v in out.items()}


def train_head(cfg: ExperimentConfig, prep, draft: str, storage: Path, run_name: str,
               tracker, register_as: str | None, data_dir: Path | None = None) -> Path:
    """Generate (into ``data_dir``, default ``<run>/data``; finished shards are reused),
    train, save next to the drafter, log and register; returns the folder."""
    import torch

    from jobs._train import fit
    from jobs.distill import generate
    from speclab.decoding.acceptance_head import AcceptanceHead, save_head

    data_dir = data_dir or storage / run_name / "data"
    t0 = time.perf_counter()
    shards, peak = generate(cfg, prep.target, data_dir, {"accept"}, prep.tokens, draft)
    tracker.log_metrics({"generate_s": time.perf_counter() - t0, "shards": shards["accept"],
                         "generate_actor_peak_rss_mb": peak})
    hcfg = cfg.model_copy(update={"models": cfg.models.model_copy(update={"draft": draft})})
    t1 = time.perf_counter()
    result = fit("head", hcfg, storage, run_name, data_dir, prep.vocab, prep.eos,
                 tracker.run_id, tracker.uri if tracker.run_id else None)
    with result.checkpoint.as_directory() as d:
        state = torch.load(Path(d) / "state.pt", weights_only=False)["model"]
    head = AcceptanceHead(state["out.weight"].shape[1], cfg.head.depth)
    head.load_state_dict(state)
    final = storage / run_name / "model"
    if final.exists():
        shutil.rmtree(final)
    shutil.copytree(draft, final, ignore=shutil.ignore_patterns("acceptance_head.*"))
    h = cfg.head
    save_head(head, final, {"w_acc": h.w_acc, "w_rej": h.w_rej, "mix_ratio": h.mix_ratio,
                            "temperature": h.temperature, "target": prep.target})
    metrics = held_out_metrics(cfg, head.eval(), draft, data_dir)
    tracker.log_metrics({"train_s": time.perf_counter() - t1,
                         "final_step": result.metrics["step"],
                         "final_val_loss": result.metrics["val_loss"], **metrics})
    print("[train_head] held-out: " + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()),
          flush=True)
    uri = tracker.log_model(final, register_as)
    print(f"[train_head] drafter + head saved to {final}"
          + (f", registered as {uri}" if uri else ""), flush=True)
    return final


def main(argv: list[str] | None = None) -> int:
    job = start_job(__doc__, argv, prepare)  # bad inputs fail here, before Ray
    cfg, tracker, (prep, draft) = job.cfg, job.tracker, job.inputs
    from speclab.raylib import init_ray

    storage, run_name = run_dirs(cfg)
    where = init_ray(job.address, cfg.ray.num_cpus)
    print(f"[train_head] running on {where}; run dir {storage / run_name}", flush=True)
    with tracker as t:
        t.set_tags({"job": "train_head", "run_dir": str(storage / run_name),
                    "target": prep.target, "draft": draft})
        train_head(cfg, prep, draft, storage, run_name, t, cfg.output.register_as)
    return 0


if __name__ == "__main__":
    sys.exit(main())

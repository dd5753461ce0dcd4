"""Train an EAGLE feature drafter for a target: target features on Ray actors, the
drafter on Ray Train (EAGLE or HASS loss), MLflow registry, evaluation with the engine.

    python -m jobs.distill_eagle --config experiments/smoke/distill_eagle.yaml [key=value ...]

Stage 1, generate: deterministic corpus windows (``distill.examples`` x ``distill.seq_len``)
go to target replicas on Ray actors, which write ``feat`` Parquet shards (tokens, the
target's last-layer features as float16 bytes, its top-``distill.top_k``) under
``<run>/data/feat`` (bounded by ``distill.examples``; whole-or-absent shards, reused on
``train.resume=true``). Stage 2, train: an :class:`~speclab.models.eagle.EagleModel` with
the target's embedding and LM head copied and frozen, ``eagle.layers`` trainable decoder
layers, the ``eagle.loss`` objective (:mod:`speclab.train.eagle`), on Ray Train with the
same loop, checkpoints and FailureConfig as every training job. At every report rank 0
logs ``loss``, ``val_loss``, ``val_top1`` and the ENGINE's figures with the current
drafter (greedy EAGLE-2 decoding of ``eagle.engine_prompts`` held-out prompts:
``engine_tau`` and ``engine_accept_at_<k>``) into the run, next to the loss curve.
Then the drafter is saved (``config.json`` naming its target + ``model.safetensors``),
registered (``output.register_as``) and evaluated: ``methods`` against plain decoding,
where ``eagle`` methods use the trained drafter.
"""

from __future__ import annotations

import time

from speclab.pipelines.cli import run_dirs, start_job
from speclab.pipelines.signals import generate, prepare_target


def save_final_eagle(result, target: str, layers: int, run_dir):
    """The last checkpoint's drafter written with :func:`~speclab.models.eagle.save_eagle`
    to ``run_dir/eagle``."""
    from pathlib import Path

    import torch

    from speclab.models.eagle import EagleModel, save_eagle
    from speclab.models.loading import load_model

    with result.checkpoint.as_directory() as d:
        state = torch.load(Path(d) / "state.pt", weights_only=False)
    model = EagleModel.from_target(load_model(target, field="models.target"), layers).float()
    model.load_state_dict(state["model"])
    return save_eagle(model, Path(run_dir) / "eagle")


def main(argv: list[str] | None = None) -> int:
    job = start_job("distill_eagle", __doc__, argv, prepare_target)  # bad inputs fail here
    cfg, tracker, prep = job.cfg, job.tracker, job.inputs

    from speclab.config.jobs import TRAINED
    from speclab.models.registry import resolve_models
    from speclab.pipelines.actor_eval import evaluate_pair, tokenized_prompts
    from speclab.pipelines.fit import fit, peak_rss_mb
    from speclab.raylib import init_ray
    from speclab.train.tasks import EagleTaskConfig

    storage, run_name = run_dirs(cfg)
    data_dir = storage / run_name / "data"
    where = init_ray(job.address, cfg.ray.num_cpus)
    print(f"[distill_eagle] running on {where}; run dir {storage / run_name}", flush=True)
    with tracker as t:
        t.set_tags({"job": "distill_eagle", "run_dir": str(storage / run_name),
                    "target": prep.target, "loss": cfg.eagle.loss})
        t0 = time.perf_counter()
        shards, actor_peak = generate(cfg, prep.target, data_dir, {"feat"}, prep.tokens)
        t.log_metrics({"generate_s": time.perf_counter() - t0,
                       "generate_driver_peak_rss_mb": peak_rss_mb(),
                       "generate_actor_peak_rss_mb": actor_peak, "shards.feat": shards["feat"]})
        print(f"[distill_eagle] generated {shards} in {time.perf_counter() - t0:.0f}s",
              flush=True)
        task = EagleTaskConfig(train=cfg.train, eagle=cfg.eagle, target=prep.target)
        t1 = time.perf_counter()
        result = fit(task, cfg.scaling, storage, run_name, data_dir, prep.vocab, prep.eos,
                     t.run_id, t.uri if t.run_id else None)
        final = save_final_eagle(result, prep.target, cfg.eagle.layers, storage / run_name)
        t.log_metrics({"train_s": time.perf_counter() - t1,
                       "final_step": result.metrics["step"],
                       "final_val_loss": result.metrics["val_loss"],
                       "final_val_top1": result.metrics["val_top1"],
                       "final_engine_tau": result.metrics.get("engine_tau", 0.0)})
        uri = t.log_model(final, cfg.output.register_as)
        print(f"[distill_eagle] drafter saved to {final}"
              + (f", registered as {uri}" if uri else ""), flush=True)
        methods = [m.model_copy(update={"eagle_model": str(final)})
                   if getattr(m, "eagle_model", None) == TRAINED else m
                   for m in cfg.method_list()]
        draft = None
        if any(m.needs_draft_model for m in methods):
            _, draft = resolve_models(cfg.models.target, cfg.models.draft)
        evaluate_pair(cfg, prep.target, draft, tokenized_prompts(cfg, prep.target), t,
                      "eval/", methods)
    return 0

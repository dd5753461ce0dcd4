"""Stage: Ray Train fitting shared by training jobs: the per-worker loop, fit, final save.

What a step trains on comes from a task in :mod:`speclab.train.tasks` (plain PyTorch),
described by its typed task config (the ``train`` group, ``arch`` and the task's own
knobs; workers get its JSON dump, never the whole experiment config);
this module adds what Ray Train needs: DDP via ``prepare_model``, checkpoints
through ``ray.train.report`` (rank 0 writes, every rank reports), resume from
``ray.train.get_checkpoint()``, and MLflow metrics from rank 0 into the run the driver
opened.
"""

from __future__ import annotations

import os
import resource
import tempfile
import time
from pathlib import Path

import torch

from speclab.config.schema import ArchConfig, TrainScalingConfig


def _build_model(arch: ArchConfig, vocab: int, eos: int):
    from transformers import LlamaForCausalLM

    from speclab.models.tiny import tiny_llama_config

    return LlamaForCausalLM(tiny_llama_config(
        vocab_size=vocab, hidden_size=arch.hidden, num_layers=arch.layers,
        num_heads=arch.heads, max_positions=arch.context, eos_token_id=eos))


def peak_rss_mb() -> float:
    """Peak resident memory of this process in MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def train_loop(config: dict) -> None:
    """Runs on every Ray Train worker; ``config["task"]`` (a task config's JSON dump)
    picks the training task."""
    import ray.train
    import ray.train.torch

    from speclab.train.lm import make_optimizer
    from speclab.train.tasks import TASKS, parse_task_config

    spec = parse_task_config(config["task"])  # workers re-validate
    tr = spec.train
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    pid_dir = Path(config["run_dir"]) / "pids"
    pid_dir.mkdir(parents=True, exist_ok=True)
    (pid_dir / f"rank{rank}.pid").write_text(str(os.getpid()))

    device = ray.train.torch.get_device()
    task = TASKS[spec.kind](spec, Path(config["data_dir"]), device)
    torch.manual_seed(tr.seed)
    if hasattr(task, "build_model"):  # e.g. an acceptance head on a frozen drafter
        model = task.build_model()
    else:
        model = _build_model(spec.arch, config["vocab"], config["eos"])
    groups = task.param_groups(model) if hasattr(task, "param_groups") else None
    opt, sched = make_optimizer(model, tr.lr, 0.01, tr.warmup, tr.steps, groups)
    start = 0
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:  # restart after a failure or an explicit resume
        with ckpt.as_directory() as d:
            state = torch.load(Path(d) / "state.pt", weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start = state["step"]
    model = ray.train.torch.prepare_model(  # a task may leave parameters without gradients
        model, parallel_strategy_kwargs={"find_unused_parameters": True}
        if getattr(task, "unused_parameters", False) else None)
    core = model.module if hasattr(model, "module") else model
    mlflow_client = None
    if rank == 0 and config.get("run_id"):
        from mlflow.tracking import MlflowClient

        mlflow_client = MlflowClient(config["tracking_uri"])
    if rank == 0 and start:
        print(f"[train] resumed from step {start}", flush=True)
        if mlflow_client is not None:  # the run records each restart, not only the log
            mlflow_client.log_metric(config["run_id"], "resumed_from_step", start, step=start)
    t_last, seen, losses = time.perf_counter(), 0, []
    for step in range(start, tr.steps):
        batch = task.batch(step, rank)  # depends only on (seed, step, rank)
        loss = task.loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        seen += task.tokens_in(batch)
        done = step + 1
        if done % tr.report_every and done != tr.steps:
            continue
        elapsed = time.perf_counter() - t_last
        metrics = {"step": done, "loss": sum(losses) / len(losses),
                   "tokens_per_s_per_worker": seen / elapsed, "peak_rss_mb": peak_rss_mb(),
                   "workers": world}
        checkpoint = None
        with tempfile.TemporaryDirectory() as tmp:
            if rank == 0:
                val_loss = task.validate(core)
                metrics["val_loss"] = val_loss
                if spec.kind == "lm":
                    metrics["val_ppl"] = float(torch.exp(torch.tensor(val_loss)))
                if hasattr(task, "val_metrics"):  # e.g. an EAGLE drafter's top-1 agreement
                    metrics.update(task.val_metrics(core))
                torch.save({"model": core.state_dict(), "opt": opt.state_dict(),
                            "sched": sched.state_dict(), "step": done}, Path(tmp) / "state.pt")
                checkpoint = ray.train.Checkpoint.from_directory(tmp)
                if mlflow_client is not None:
                    from mlflow.entities import Metric

                    now = int(time.time() * 1000)
                    mlflow_client.log_batch(config["run_id"], metrics=[
                        Metric(k, float(v), now, done) for k, v in metrics.items()])
                print(f"[train] step {done}/{tr.steps} loss {metrics['loss']:.3f} "
                      f"val {val_loss:.3f} {metrics['tokens_per_s_per_worker']:.0f} tok/s/worker",
                      flush=True)
            ray.train.report(metrics, checkpoint=checkpoint)
        t_last, seen, losses = time.perf_counter(), 0, []


def fit(task, scaling: TrainScalingConfig, storage: Path, run_name: str, data_dir: Path,
        vocab: int, eos: int, run_id: str | None, tracking_uri: str | None):
    """Run :func:`train_loop` for ``task`` (a :mod:`speclab.train.tasks` task config) on
    a ``TorchTrainer`` with ``scaling`` workers; returns the Ray result."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    sc = scaling
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"task": task.model_dump(mode="json"), "data_dir": str(data_dir),
                           "run_dir": str(storage / run_name), "vocab": vocab, "eos": eos,
                           "run_id": run_id, "tracking_uri": tracking_uri},
        scaling_config=ScalingConfig(num_workers=sc.num_workers, use_gpu=sc.use_gpu,
                                     resources_per_worker={"CPU": sc.cpus_per_worker}),
        run_config=RunConfig(
            name=run_name, storage_path=str(storage),
            failure_config=FailureConfig(max_failures=task.train.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=2)),
    )
    return trainer.fit()


def save_final(result, arch: ArchConfig, run_dir: Path, tokenizer_dir: Path, vocab: int,
               eos: int) -> Path:
    """Load the last checkpoint of a LLaMA of ``arch`` and write model + tokenizer with
    ``save_pretrained``."""
    from transformers import AutoTokenizer

    with result.checkpoint.as_directory() as d:
        state = torch.load(Path(d) / "state.pt", weights_only=False)
    model = _build_model(arch, vocab, eos)
    model.load_state_dict(state["model"])
    model.generation_config.eos_token_id = eos
    final = run_dir / "model"
    model.save_pretrained(final)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(final)
    return final

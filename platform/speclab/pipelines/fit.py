"""Stage: Ray Train fitting shared by training jobs: the per-worker loop, fit, final save.

What a step trains on comes from a task in :mod:`speclab.train.tasks` (plain PyTorch),
described by its typed task config (the ``train`` group, ``arch`` and the task's own
knobs; workers get its JSON dump, never the whole experiment config);
this module adds what Ray Train needs: DDP via ``prepare_model``, checkpoints
through ``ray.train.report`` (rank 0 writes, every rank reports), resume from
``ray.train.get_checkpoint()``, and MLflow metrics from rank 0 into the run the driver
opened.

Tracking outages: rank 0 never logs to MLflow directly; its metrics go through a
:class:`speclab.tracking_buffer.MetricBuffer` (a background thread delivers them, an
outage only queues them, in order, with their steps and timestamps; see that module for
the limits and ``$SPECLAB_TRACKING_FLUSH_TIMEOUT_S``). After the last step rank 0 waits
up to that long for the queue to empty and leaves what it could not deliver in
``<run dir>/tracking_spool.json``. :func:`fit` then tries once more from the driver and,
failing that, raises :class:`speclab.tracking.TrackingUnavailable` naming the server and
the number of undelivered points: the job exits non-zero, its run is never ended
FINISHED, and its checkpoints are complete, so ``train.resume=true`` (same
``output.run_name``) delivers the spooled points to the old run and finishes the job.
"""

from __future__ import annotations

import os
import resource
import tempfile
import time
from dataclasses import asdict, is_dataclass
from pathlib import Path

import torch

from speclab.config.schema import ArchConfig, TrainScalingConfig
from speclab.models.tiny import tiny_llama_config
from speclab.timing import peak_gpu_mb
from speclab.tracking import TrackingUnavailable
from speclab.tracking_buffer import (
    SPOOL_NAME,
    MetricBuffer,
    deliver_spool,
    flush_timeout_s,
    load_spool,
    quiet_mlflow_http,
)
from speclab.train.lm import make_optimizer
from speclab.train.tasks import Task, parse_task_config, task_class

#: the driver's last attempt at a spool the workers left (after their own flush budget)
DRIVER_FLUSH_S = 10.0


def _build_model(arch: ArchConfig, vocab: int, eos: int):
    """A LLaMA of ``arch`` at random, or, with ``arch.init_from`` (a drafter's
    :class:`~speclab.config.schema.DraftArchConfig`, resolved to a folder), that model
    cut to ``arch.layers`` layers (:func:`speclab.models.pruned.cut_model`)."""
    from transformers import LlamaForCausalLM

    source = getattr(arch, "init_from", None)
    if source:
        from speclab.models.pruned import cut_model

        return cut_model(source, arch.layers, vocab, eos)
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

    spec = parse_task_config(config["task"])  # workers re-validate
    tr = spec.train
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    pid_dir = Path(config["run_dir"]) / "pids"
    pid_dir.mkdir(parents=True, exist_ok=True)
    (pid_dir / f"rank{rank}.pid").write_text(str(os.getpid()))

    device = ray.train.torch.get_device()
    task: Task = task_class(spec.kind)(spec, Path(config["data_dir"]), device)
    torch.manual_seed(tr.seed)
    model = task.build_model()  # e.g. an acceptance head on a frozen drafter
    if model is None:  # the task trains a LLaMA of its arch
        model = _build_model(spec.arch, config["vocab"], config["eos"])
    groups = task.param_groups(model)
    opt, sched = make_optimizer(model, tr.lr, 0.01, tr.warmup, tr.steps, groups)
    start, state = 0, None
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:  # restart after a failure or an explicit resume
        with ckpt.as_directory() as d:  # read on the CPU, whatever device wrote it
            state = torch.load(Path(d) / "state.pt", weights_only=False, map_location="cpu")
        model.load_state_dict(state["model"])
        start = state["step"]
    model = ray.train.torch.prepare_model(  # a task may leave parameters without gradients
        model, parallel_strategy_kwargs={"find_unused_parameters": True}
        if task.unused_parameters else None)
    if state is not None:  # now that the parameters are on the worker's device: the
        opt.load_state_dict(state["opt"])  # optimizer's state follows them there
        sched.load_state_dict(state["sched"])
    core = model.module if hasattr(model, "module") else model
    metrics_out = _metric_buffer(config) if rank == 0 else None
    spool = Path(config["run_dir"]) / SPOOL_NAME
    if rank == 0 and start:
        print(f"[train] resumed from step {start}", flush=True)
        if metrics_out is not None:  # the run records each restart, not only the log
            metrics_out.add(config["run_id"], {"resumed_from_step": start}, step=start)
    t_last, seen, losses = time.perf_counter(), 0, []
    amp = tr.precision != "float32"  # mixed precision: float32 weights, autocast loss
    amp_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(tr.precision)
    scaler = torch.amp.GradScaler(device.type) if tr.precision == "float16" else None
    if scaler is not None and state is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])  # a resumed run keeps its loss scale
    t_begin = time.perf_counter()
    for step in range(start, tr.steps):
        batch = task.batch(step, rank)  # depends only on (seed, step, rank)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp):
            loss = global_share(task.loss(model, batch), task.scored(batch), world, device)
        opt.zero_grad(set_to_none=True)
        if scaler is not None:  # float16: scaled gradients, unscaled before clipping
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        else:
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        sched.step()
        losses.append(loss.item())
        seen += task.tokens_in(batch)
        done = step + 1
        if done % tr.report_every and done != tr.steps:
            continue
        elapsed = time.perf_counter() - t_last
        eta = (time.perf_counter() - t_begin) / (done - start) * (tr.steps - done)
        metrics = {"step": done, "loss": global_mean(sum(losses) / len(losses), world, device),
                   "tokens_per_s_per_worker": seen / elapsed, "peak_rss_mb": peak_rss_mb(),
                   "peak_gpu_mb": peak_gpu_mb(next(model.parameters()).device),
                   "workers": world}
        checkpoint = None
        with tempfile.TemporaryDirectory() as tmp:
            if rank == 0:
                val_loss = task.validate(core)
                metrics["val_loss"] = val_loss
                if spec.kind == "lm":
                    metrics["val_ppl"] = float(torch.exp(torch.tensor(val_loss)))
                metrics.update(task.val_metrics(core))  # e.g. a drafter's top-1 agreement
                meta = getattr(core, "meta", None)  # a drafter's architecture (EAGLE)
                torch.save({"model": core.state_dict(), "opt": opt.state_dict(),
                            "sched": sched.state_dict(), "step": done,
                            "meta": asdict(meta) if is_dataclass(meta) else None,
                            "scaler": scaler.state_dict() if scaler is not None else None},
                           Path(tmp) / "state.pt")
                checkpoint = ray.train.Checkpoint.from_directory(tmp)
                if metrics_out is not None:  # never blocks: a background thread sends it
                    metrics_out.add(config["run_id"], metrics, step=done)
                    metrics_out.save(spool)  # only while the server is unreachable
                print(f"[train] step {done}/{tr.steps} loss {metrics['loss']:.3f} "
                      f"val {val_loss:.3f} {metrics['tokens_per_s_per_worker']:.0f} tok/s/worker"
                      f", ETA {eta / 60:.1f} min", flush=True)
            ray.train.report(metrics, checkpoint=checkpoint)
        t_last, seen, losses = time.perf_counter(), 0, []
    if metrics_out is not None:  # wait (bounded) for the server; spool what is left
        _final_flush(metrics_out, config, spool)


def global_mean(value: float, world: int, device: torch.device | None = None) -> float:
    """``value`` averaged over the ``world`` workers (every rank calls it at the same
    step): the training loss of the whole global batch, so a run on 2 workers reports the
    curve a run on 1 worker with the same global batch reports."""
    if world <= 1:
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device)  # NCCL: on the GPU
    dist.all_reduce(t)
    return float(t.item()) / world


def global_share(loss: torch.Tensor, scored: float | None, world: int,
                 device: torch.device | None = None) -> torch.Tensor:
    """A worker's masked-mean ``loss`` over its ``scored`` positions, rescaled so that
    DDP's average over the ``world`` workers (of gradients and of the reported loss) is
    the masked mean over the whole global batch: ``loss * scored * world / sum(scored)``
    (every rank calls it at the same step). Without a mask (``scored`` None) or on one
    worker: ``loss`` unchanged. Exact for a loss with one mask; a loss that sums terms
    over shorter masks (EAGLE-3's later steps) is weighted by its first term's."""
    if world <= 1 or scored is None:
        return loss
    import torch.distributed as dist

    t = torch.tensor([scored], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    total = float(t.item())
    return loss * (scored * world / total) if total > 0 else loss


def _metric_buffer(config: dict):
    """Rank 0's metric buffer (with what an earlier attempt spooled), or None without a
    run to log to."""
    if not config.get("run_id"):
        return None

    quiet_mlflow_http()  # the buffer retries; one request must not block for minutes
    buf = MetricBuffer(config["tracking_uri"])
    spooled, header = load_spool(Path(config["run_dir"]) / SPOOL_NAME)
    # points an earlier attempt lost stay counted: the job must still fail for them
    buf.dropped = int(header.get("dropped", 0))
    buf.rejected = int(header.get("rejected", 0))
    if spooled:
        print(f"[tracking] {len(spooled)} metric points spooled by an earlier attempt "
              "are queued for delivery", flush=True)
        buf.extend(spooled)
    return buf.start()


def _final_flush(buf, config: dict, spool: Path) -> None:
    """Wait up to ``flush_timeout_s`` for the buffer to empty; spool the rest."""
    timeout = float(config.get("flush_timeout_s", 120.0))
    t0 = time.monotonic()
    left = buf.close(timeout)
    buf.save(spool, force=bool(left))
    if left or buf.dropped or buf.rejected:
        print(f"[tracking] ERROR: {left} metric points not delivered to MLflow server "
              f"{buf.uri} within {timeout:.0f} s (dropped {buf.dropped}, rejected "
              f"{buf.rejected}); kept in {spool}", flush=True)
    elif buf.outages:
        print(f"[tracking] all {buf.delivered} metric points delivered to {buf.uri} "
              f"({buf.outages} outage(s); final flush {time.monotonic() - t0:.1f} s)",
              flush=True)


def fit(task, scaling: TrainScalingConfig, storage: Path, run_name: str, data_dir: Path,
        vocab: int, eos: int, run_id: str | None, tracking_uri: str | None):
    """Run :func:`train_loop` for ``task`` (a :mod:`speclab.train.tasks` task config) on
    a ``TorchTrainer`` with ``scaling`` workers; returns the Ray result.

    Raises :class:`speclab.tracking.TrackingUnavailable` when rank 0's metrics could not
    all be delivered to ``tracking_uri`` (the checkpoints are complete: resume)."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    sc = scaling
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"task": task.model_dump(mode="json"), "data_dir": str(data_dir),
                           "run_dir": str(storage / run_name), "vocab": vocab, "eos": eos,
                           "run_id": run_id, "tracking_uri": tracking_uri,
                           "flush_timeout_s": flush_timeout_s()},
        scaling_config=ScalingConfig(num_workers=sc.num_workers, use_gpu=sc.use_gpu,
                                     resources_per_worker={"CPU": sc.cpus_per_worker}),
        run_config=RunConfig(
            name=run_name, storage_path=str(storage),
            failure_config=FailureConfig(max_failures=task.train.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=2)),
    )
    result = trainer.fit()
    if run_id and tracking_uri:
        check_metrics_delivered(storage / run_name, tracking_uri, run_name)
    return result


def check_metrics_delivered(run_dir: Path, tracking_uri: str, run_name: str) -> None:
    """Raise :class:`speclab.tracking.TrackingUnavailable` if the workers left metric
    points they could not deliver in ``run_dir`` (after one more try of
    :data:`DRIVER_FLUSH_S` from here), naming the server and the count."""

    spool = Path(run_dir) / SPOOL_NAME
    if not spool.exists():
        return
    print(f"[tracking] the workers left undelivered metric points in {spool}; trying "
          f"{tracking_uri} for {DRIVER_FLUSH_S:.0f} s more", flush=True)
    out = deliver_spool(spool, tracking_uri, DRIVER_FLUSH_S, log=lambda _msg: None)
    lost = out["undelivered"] + out["dropped"] + out["rejected"]
    if not lost:
        print(f"[tracking] delivered {out['delivered']} spooled metric points to "
              f"{tracking_uri}", flush=True)
        return
    error = (out["last_error"] or "")[:120]
    parts = [f"{out['undelivered']} undelivered (the server did not answer: {error})"
             if out["undelivered"] else "",
             f"{out['dropped']} dropped (buffer full)" if out["dropped"] else "",
             f"{out['rejected']} rejected by the server" if out["rejected"] else ""]
    raise TrackingUnavailable(
        f"{lost} metric points of this training did not reach MLflow server {tracking_uri}: "
        + "; ".join(p for p in parts if p)
        + (f". The undelivered points are kept in {spool}" if out["undelivered"] else "")
        + f"; the run is not marked FINISHED. The checkpoints in {run_dir} are complete: "
        f"once the server is back, rerun with train.resume=true output.run_name={run_name} "
        "to deliver the kept points and finish the job.")


def save_final(result, arch: ArchConfig, run_dir: Path, tokenizer_dir: Path, vocab: int,
               eos: int) -> Path:
    """Load the last checkpoint of a LLaMA of ``arch`` and write model + tokenizer with
    ``save_pretrained``."""
    from transformers import AutoTokenizer

    with result.checkpoint.as_directory() as d:
        state = torch.load(Path(d) / "state.pt", weights_only=False, map_location="cpu")
    model = _build_model(arch, vocab, eos)
    model.load_state_dict(state["model"])
    model.generation_config.eos_token_id = eos
    final = run_dir / "model"
    model.save_pretrained(final)
    AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=False).save_pretrained(final)
    return final

"""Ray Train on one GPU (skipped without CUDA), each job run as a user runs it
(``python -m jobs.<name>``, embedded Ray on 127.0.0.1), about a minute each on one H100:

- ``train_target`` with ``scaling.use_gpu: true`` (one worker): the worker is killed after
  a committed checkpoint, the group restarts from it and trains to the end; the
  checkpoint written after the resume holds the optimizer's moments on CUDA
  (``pipelines/fit.py`` loads the optimizer state after ``prepare_model`` moved the
  parameters; before, a CPU state met CUDA parameters in ``AdamW.step``);
- MEDUSA-1 heads trained on the GPU (``train_medusa``, variant ``medusa1``): the first
  report (loss, head accuracies, the engine's figures with the heads on CUDA, lossless)
  and the rest of the job (calibration, evaluation) to exit status 0;
- ``train.precision: float16`` with the GradScaler: finite losses that fall.

The CPU tests at the end check what these tests rely on without a GPU (their configs
validate, the checkpoint reader) in about a second.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.integration.conftest import ROOT, find_run, python, run_cmd, stop_process_tree
from tests.integration.test_train_target import SMOKE, _committed_checkpoint

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
MEDUSA = "experiments/smoke/train_medusa.yaml"
GPU_WORKER = ["scaling.num_workers=1", "scaling.use_gpu=true", "scaling.cpus_per_worker=1"]
# long enough to kill the worker after its first checkpoint: ~10 s of steps on an H100
KILL_STEPS, KILL_EVERY = 900, 30
KILLED_RUN = [*GPU_WORKER, f"train.steps={KILL_STEPS}", f"train.report_every={KILL_EVERY}",
              "arch.layers=3", "arch.hidden=96", "output.run_name=ft",
              "output.register_as=null", "tracking.experiment=cuda-fault"]
FLOAT16_RUN = [*GPU_WORKER, "train.precision=float16", "output.run_name=fp16",
               "output.register_as=null", "tracking.experiment=cuda-fp16"]
MEDUSA1_RUN = [*GPU_WORKER, "medusa.variants=[medusa1]", "output.run_name=mg",
               "output.register_as=null", "tracking.experiment=cuda-medusa",
               "methods=[{name: medusa, tree: chain, label: medusa-chain}]"]


def checkpoint_state(run_dir: Path) -> tuple[int, dict[str, set[str]]]:
    """The latest training checkpoint under ``run_dir`` (``state.pt`` as ``fit.py``
    writes it): its step, and the device types its tensors were saved from, per part:
    ``{"model": {...}, "opt": {...}}`` (the optimizer's moments; AdamW keeps its ``step``
    counters on the CPU by design, so they are left out). ``torch.load`` without a
    ``map_location`` puts every tensor back where it was saved."""
    states = [torch.load(p, weights_only=False) for p in Path(run_dir).rglob("state.pt")]
    assert states, f"no checkpoint under {run_dir}"
    state = max(states, key=lambda s: s["step"])
    where = {"model": {t.device.type for t in state["model"].values()},
             "opt": {t.device.type for s in state["opt"]["state"].values()
                     for k, t in s.items() if torch.is_tensor(t) and k != "step"}}
    return int(state["step"]), where


def _kill_worker_after_a_checkpoint(proc: subprocess.Popen, run_dir: Path, log: Path,
                                    rank: int = 0, timeout: float = 240) -> int:
    """Wait for a committed checkpoint of the run (and the worker's pid file), SIGKILL
    worker ``rank``; returns its pid (the mechanism of
    ``tests/integration/test_train_target.py::test_killed_worker_resumes_from_checkpoint``)."""
    pid_file = run_dir / "pids" / f"rank{rank}.pid"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if _committed_checkpoint(run_dir) and pid_file.exists():
            break
        if proc.poll() is not None:
            pytest.fail("job ended before a checkpoint: " + log.read_text()[-3000:])
        time.sleep(0.1)
    else:
        pytest.fail("no checkpoint appeared: " + log.read_text()[-3000:])
    victim = int(pid_file.read_text())
    try:
        os.kill(victim, signal.SIGKILL)
    except ProcessLookupError:
        pytest.fail(f"rank {rank} (pid {victim}) was gone before it could be killed: "
                    "raise the test's train.steps")
    return victim


@pytest.mark.gpu
@pytest.mark.integration
@CUDA
def test_killed_gpu_worker_resumes_with_its_optimizer_state_on_cuda(job_env, tmp_path):
    storage = tmp_path / "runs"
    run_dir = storage / "ft"
    log = tmp_path / "job.log"
    args = [python(), "-m", "jobs.train_target", "--config", SMOKE, *KILLED_RUN,
            f"output.storage_path={storage}"]
    with open(log, "w") as out:  # a file, not a pipe nobody reads while we wait
        proc = subprocess.Popen(args, cwd=ROOT, env=job_env, stdout=out,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        victim = _kill_worker_after_a_checkpoint(proc, run_dir, log)
        proc.wait(timeout=300)
    finally:  # whatever the job left of its process tree (its embedded Ray), and only that
        stop_process_tree(proc, grace=30)
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    # a new worker process, restored from the checkpoint, trained on to the last step
    assert int((run_dir / "pids" / "rank0.pid").read_text()) != victim, text[-4000:]
    client, run = find_run(job_env["MLFLOW_TRACKING_URI"], "cuda-fault")
    resumed = [m.value for m in client.get_metric_history(run.info.run_id, "resumed_from_step")]
    assert resumed and all(0 < r < KILL_STEPS for r in resumed), text[-4000:]
    losses = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}
    after = [s for s in losses if s > max(resumed)]
    assert after and max(after) == KILL_STEPS, sorted(losses)  # reported after the resume
    assert all(math.isfinite(losses[s]) for s in after)
    assert run.data.metrics["final_step"] == KILL_STEPS
    # the last checkpoint was written by the resumed worker: its optimizer state (loaded
    # from a checkpoint read on the CPU) had followed the parameters onto the GPU
    step, where = checkpoint_state(run_dir)
    assert step == KILL_STEPS > max(resumed)
    assert where == {"model": {"cuda"}, "opt": {"cuda"}}, where
    assert (run_dir / "model" / "config.json").exists()


@pytest.mark.gpu
@pytest.mark.integration
@CUDA
def test_medusa1_heads_train_on_the_gpu_through_their_reports_to_the_end(job_env, tmp_path):
    from mlflow.tracking import MlflowClient

    storage = tmp_path / "runs"
    res = run_cmd([python(), "-m", "jobs.train_medusa", "--config", MEDUSA, *MEDUSA1_RUN,
                   f"output.storage_path={storage}"], job_env, timeout=480)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    client = MlflowClient(job_env["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("cuda-medusa")
    runs = client.search_runs([exp.experiment_id])
    child = next(r for r in runs if r.data.tags.get("variant") == "medusa1")
    for key in ("loss", "val_loss", "val_head1_top1", "engine_tau"):  # the first report on
        steps = [h.step for h in client.get_metric_history(child.info.run_id, key)]
        assert steps == [6, 12], (key, steps)
    m = child.data.metrics
    assert m["final_step"] == 12 and math.isfinite(m["final_val_loss"])
    assert m["engine_identical"] == 1.0  # greedy SD with the CUDA heads == plain decoding
    assert m["expected_tau.chain"] >= 1.0
    step, where = checkpoint_state(storage / "mg-medusa1")
    assert step == 12 and where == {"model": {"cuda"}, "opt": {"cuda"}}, where
    assert (storage / "mg-medusa1" / "medusa" / "tree.json").exists()


@pytest.mark.gpu
@pytest.mark.integration
@CUDA
def test_float16_with_the_grad_scaler_trains_on_the_gpu(job_env, tmp_path):
    storage = tmp_path / "runs"
    res = run_cmd([python(), "-m", "jobs.train_target", "--config", SMOKE, *FLOAT16_RUN,
                   f"output.storage_path={storage}"], job_env, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    client, run = find_run(job_env["MLFLOW_TRACKING_URI"], "cuda-fp16")
    assert run.data.params["train.precision"] == "float16"
    loss = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}
    assert sorted(loss) == [10, 20, 30]
    assert all(math.isfinite(v) for v in loss.values()), loss  # scaled, unscaled, clipped
    assert loss[30] < loss[10], loss  # it trains (not every step skipped by the scaler)
    assert math.isfinite(run.data.metrics["final_val_loss"])
    step, where = checkpoint_state(storage / "fp16")
    assert step == 30 and where == {"model": {"cuda"}, "opt": {"cuda"}}, where


# ---------------------------------------------------------------- without a GPU
def test_the_gpu_runs_configs_are_valid():
    """The overrides above make valid configs (a typo would fail only on a GPU machine)."""
    from speclab.config import TrainMedusaJob, TrainTargetJob

    for overrides in (KILLED_RUN, FLOAT16_RUN):
        cfg = TrainTargetJob.from_yaml(ROOT / SMOKE, overrides)
        assert cfg.scaling.use_gpu and cfg.scaling.num_workers == 1
        assert cfg.output.register_as is None
    assert TrainTargetJob.from_yaml(ROOT / SMOKE, FLOAT16_RUN).train.precision == "float16"
    cfg = TrainMedusaJob.from_yaml(ROOT / MEDUSA, MEDUSA1_RUN)
    assert cfg.scaling.use_gpu and cfg.medusa.variants == ["medusa1"]
    assert [m.label for m in cfg.method_list()] == ["medusa-chain"]
    assert cfg.train.report_every == 6 and cfg.train.steps == 12  # what the test expects


def test_checkpoint_state_reads_the_latest_checkpoint_and_its_devices(tmp_path):
    """:func:`checkpoint_state` on checkpoints written the way ``fit.py`` writes them."""
    from speclab.train.lm import make_optimizer

    model = torch.nn.Linear(4, 3)
    opt, sched = make_optimizer(model, 1e-2, 0.01, 1, 10)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    for step in (20, 40):
        folder = tmp_path / f"checkpoint_{step}"
        folder.mkdir()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                    "sched": sched.state_dict(), "step": step}, folder / "state.pt")
    assert checkpoint_state(tmp_path) == (40, {"model": {"cpu"}, "opt": {"cpu"}})

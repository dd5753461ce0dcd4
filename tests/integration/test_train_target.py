"""jobs.train_target on local Ray Train: registry round trip, worker failure, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.conftest import (
    ROOT,
    find_run,
    python,
    refused_before_work,
    run_cmd,
    stop_process_tree,
)

pytestmark = pytest.mark.integration
SMOKE = "experiments/smoke/train_target.yaml"


def test_registered_target_loads_into_the_engine(job_env, tmp_path, monkeypatch):
    res = run_cmd([python(), "-m", "jobs.train_target", "--config", SMOKE,
                   f"output.storage_path={tmp_path / 'runs'}",
                   "train.precision=bfloat16"], job_env)  # mixed precision (autocast)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "registered as models:/speclab-smoke-target/1" in res.stdout
    client, run = find_run(job_env["MLFLOW_TRACKING_URI"], "speclab-smoke")
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "loss")]
    assert steps == [10, 20, 30]
    loss = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}
    assert loss[30] < loss[10], loss  # it trains under bfloat16 autocast
    assert run.data.params["train.precision"] == "bfloat16"
    assert run.data.metrics["final_step"] == 30
    assert run.data.metrics["tokens_per_s_per_worker"] > 0
    assert run.data.metrics["peak_rss_mb"] > 0

    from speclab.api import Decoder

    monkeypatch.setenv("MLFLOW_TRACKING_URI", job_env["MLFLOW_TRACKING_URI"])
    dec = Decoder.from_pretrained("models:/speclab-smoke-target/1")
    out = dec.generate("def main(", method="ar", max_new_tokens=8)
    assert len(out.token_ids) == 8 and isinstance(out.text, str)


def _committed_checkpoint(run_dir: Path) -> bool:
    """True once Ray Train's controller has registered a checkpoint of the run.

    A ``checkpoint_*`` folder appears when rank 0 uploads it, before every rank has
    reported that step; killing a worker in between restarts from scratch, correctly.
    The controller's snapshot file names the latest checkpoint once it is committed.
    """
    snap = run_dir / "checkpoint_manager_snapshot.json"
    try:
        state = json.loads(snap.read_text())
    except (OSError, ValueError):
        return False
    return bool(state.get("latest_checkpoint_result"))


def test_killed_worker_resumes_from_checkpoint(job_env, tmp_path):
    storage = tmp_path / "runs"
    run_dir = storage / "ft"
    args = [python(), "-m", "jobs.train_target", "--config", SMOKE, "train.steps=300",
            "train.report_every=20", "arch.layers=3", "arch.hidden=96",
            f"output.storage_path={storage}", "output.run_name=ft", "output.register_as=null",
            "tracking.experiment=fault"]
    proc = subprocess.Popen(args, cwd=ROOT, env=job_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline:  # wait for a committed checkpoint, then kill rank 1
            if _committed_checkpoint(run_dir) and (run_dir / "pids" / "rank1.pid").exists():
                break
            if proc.poll() is not None:
                pytest.fail("job ended before a checkpoint: " + proc.stdout.read()[-3000:])
            time.sleep(0.2)
        else:
            pytest.fail("no checkpoint appeared")
        victim = int((run_dir / "pids" / "rank1.pid").read_text())
        os.kill(victim, signal.SIGKILL)
        out, _ = proc.communicate(timeout=420)
    finally:  # whatever the job left of its process tree (its embedded Ray), and only that
        stop_process_tree(proc, grace=30)
    assert proc.returncode == 0, out[-4000:]
    # the worker group was restarted: a new rank-1 process, and rank 0 recorded the resume
    assert int((run_dir / "pids" / "rank1.pid").read_text()) != victim, out[-4000:]
    client, run = find_run(job_env["MLFLOW_TRACKING_URI"], "fault")
    resumed = client.get_metric_history(run.info.run_id, "resumed_from_step")
    assert resumed and all(0 < m.value < 300 for m in resumed), out[-4000:]
    assert run.data.metrics["final_step"] == 300
    steps = sorted({m.step for m in client.get_metric_history(run.info.run_id, "loss")})
    assert steps[-1] == 300 and all(s % 20 == 0 for s in steps)
    assert (run_dir / "model" / "config.json").exists()


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["corpus.source=text_folder", "corpus.path=/nonexistent/corpus"],
         "corpus.path: folder '/nonexistent/corpus' does not exist"),
        (["corpus.source=jsonl", "corpus.path={empty}"], "is empty"),
        (["tokenizer.path=/nonexistent/tok"], "tokenizer.path"),
        (["arch.hidden=100", "arch.heads=3"], "hidden (100) must be divisible by heads (3)"),
        (["train.resume=true"], "output.run_name: required"),
        (["train.precision=float16"], "train.precision: float16 needs GPUs"),
    ],
)
def test_bad_input_fails_before_training(job_env, tmp_path, overrides, message):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    overrides = [o.replace("{empty}", str(empty)) for o in overrides]
    refused_before_work("train_target", SMOKE, overrides, message, job_env,
                        tmp_path / "runs")  # no Ray, no training
    assert not list(Path(tmp_path / "runs").rglob("checkpoint_*"))

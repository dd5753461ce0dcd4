"""A Ray Tune sweep on CUDA (skipped without a GPU): the smoke sweep with
``models.device=cuda`` reserves a GPU per trial, so Ray gives each trial a GPU of its own
(``CUDA_VISIBLE_DEVICES``), its models load there and the sweep's t_draft / t_target are
timed there."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.conftest import python, run_cmd

pytestmark = [pytest.mark.gpu, pytest.mark.integration,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SMOKE = "experiments/smoke/tune.yaml"


def _env(tmp_path: Path) -> dict[str, str]:
    """As tests/integration's ``job_env``: an own SPECLAB_HOME and SQLite MLflow store."""
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.update({"SPECLAB_HOME": str(tmp_path / "home"),
                "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
                "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
                "PYTHONUNBUFFERED": "1",
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"})
    return env


def test_a_cuda_sweep_runs_every_trial_on_a_gpu_of_its_own(tmp_path):
    from mlflow.tracking import MlflowClient

    env, storage = _env(tmp_path), tmp_path / "runs"
    res = run_cmd([python(), "-m", "jobs.tune", "--config", SMOKE, "models.device=cuda",
                   "tracking.experiment=cuda-tune", f"output.storage_path={storage}",
                   "output.run_name=cu", "sweep.space={method.name: {grid: [tree, salf]}}"],
                  env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "loads its models on cuda" in res.stdout, res.stdout[-2000:]
    starts = [json.loads(line) for line in
              (storage / "cu" / "trial_starts.jsonl").read_text().splitlines()]
    assert len(starts) == 2
    for s in starts:  # each trial: cuda, with the one GPU Ray reserved for it
        visible = s["cuda_visible_devices"]
        assert s["device"] == "cuda" and visible and len(visible.split(",")) == 1, s
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("cuda-tune")
    runs = client.search_runs([exp.experiment_id])
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert parent.data.tags["trial_device"] == "cuda" and parent.data.tags["trial_gpus"] == "1"
    assert parent.data.metrics["t_draft_s"] > 0 and parent.data.metrics["t_target_s"] > 0
    assert len(children) == 2
    for c in children:
        assert c.data.tags["status"] == "ok", c.data.tags
        assert c.data.metrics["predicted_speedup"] > 0 and c.data.metrics["tau"] >= 1

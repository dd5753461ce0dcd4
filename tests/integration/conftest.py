"""Integration helpers: isolated SPECLAB_HOME / MLflow store, free ports, subprocess jobs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def job_env(tmp_path) -> dict[str, str]:
    """Environment for a job subprocess: its own SPECLAB_HOME and SQLite MLflow store."""
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.update({
        "SPECLAB_HOME": str(tmp_path / "home"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "PYTHONUNBUFFERED": "1",
        # as if the venv were activated: `python` in job entrypoints is the venv's
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
    })
    return env


def run_cmd(args: list[str], env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def python() -> str:
    return sys.executable


def find_run(tracking_uri: str, experiment: str):
    """The single finished run of ``experiment`` in the store, via the MLflow client."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"experiment {experiment!r} not found"
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return client, runs[0]

"""`speclab ui` serves the MLflow UI on 127.0.0.1 over the store jobs write to."""

from __future__ import annotations

import subprocess
import time

import pytest
import requests

from tests.integration.conftest import (
    ROOT,
    free_port,
    listening_addresses,
    python,
    stop_process_tree,
)

pytestmark = pytest.mark.integration


def test_ui_serves_the_embedded_store(job_env, monkeypatch):
    import mlflow

    from speclab import tracking

    del job_env["MLFLOW_TRACKING_URI"]  # the embedded default under SPECLAB_HOME
    monkeypatch.setenv("SPECLAB_HOME", job_env["SPECLAB_HOME"])
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with tracking.open_tracker(True, None, "ui-check", "r1", {"a": {"b": 1}}) as t:
        t.log_metrics({"tau": 2.5}, step=1)
    mlflow.set_tracking_uri(None)
    port = free_port()
    proc = subprocess.Popen([python(), "-m", "speclab.cli", "ui", "--port", str(port)],
                            cwd=ROOT, env=job_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 90
        while time.time() < deadline:
            try:
                if requests.get(base, timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                time.sleep(0.5)
        else:
            pytest.fail("MLflow UI did not come up")
        assert listening_addresses(port) == {"127.0.0.1"}  # never on other interfaces
        exps = requests.post(f"{base}/api/2.0/mlflow/experiments/search",
                             json={"max_results": 50}, timeout=10).json()["experiments"]
        exp = next(e for e in exps if e["name"] == "ui-check")
        runs = requests.post(f"{base}/api/2.0/mlflow/runs/search",
                             json={"experiment_ids": [exp["experiment_id"]]},
                             timeout=10).json()["runs"]
        assert len(runs) == 1
        assert {"key": "tau", "value": 2.5} in [
            {"key": m["key"], "value": m["value"]} for m in runs[0]["data"]["metrics"]]
        params = {p["key"]: p["value"] for p in runs[0]["data"]["params"]}
        assert params["a.b"] == "1"
    finally:  # `speclab ui` and the mlflow server it runs: its whole process group
        stop_process_tree(proc, grace=30)

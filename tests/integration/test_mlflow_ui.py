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
    run_cmd,
    stop_process_tree,
)

pytestmark = pytest.mark.integration


def _wait_up(base: str) -> None:
    deadline = time.time() + 90
    while time.time() < deadline:
        try:
            if requests.get(base, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            time.sleep(0.5)
    pytest.fail("MLflow UI did not come up")


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
        _wait_up(base)
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
        # a job's printed link names the port of the UI running now, not always 5000
        assert tracking.run_link(t).startswith(f"{base}/#/experiments/")
    finally:  # `speclab ui` and the mlflow server it runs: its whole process group
        stop_process_tree(proc, grace=30)
    assert not tracking.ui_record().exists()  # removed when the UI stops
    assert tracking.run_link(t).startswith("http://127.0.0.1:5000/")


def test_ui_lists_one_child_run_per_method_with_identical_metric_keys(job_env):
    """A smoke evaluation into the embedded store, then `speclab ui` over it: through
    MLflow's REST API the evaluation's parent run has one FINISHED child per method (AR
    included), each with `method.*` params and the same metric keys, and the parent
    holds the table, the plots and `best_*`."""
    del job_env["MLFLOW_TRACKING_URI"]  # the embedded default under SPECLAB_HOME
    res = run_cmd([python(), "-m", "jobs.evaluate", "--config",
                   "experiments/smoke/evaluate.yaml", "resources.num_actors=1"], job_env)
    assert res.returncode == 0, res.stderr[-3000:]
    port = free_port()
    proc = subprocess.Popen([python(), "-m", "speclab.cli", "ui", "--port", str(port)],
                            cwd=ROOT, env=job_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_up(base)
        api = f"{base}/api/2.0/mlflow"
        exps = requests.post(f"{api}/experiments/search", json={"max_results": 50},
                             timeout=10).json()["experiments"]
        exp = next(e for e in exps if e["name"] == "speclab-smoke")
        tags = {t["key"]: t["value"] for t in exp.get("tags", [])}
        assert tags["mlflow.experimentKind"] == "custom_model_development"
        runs = requests.post(f"{api}/runs/search", json={
            "experiment_ids": [exp["experiment_id"]], "max_results": 100},
            timeout=10).json()["runs"]

        def tags_of(run: dict) -> dict:
            return {t["key"]: t["value"] for t in run["data"].get("tags", [])}

        parents = [r for r in runs if "mlflow.parentRunId" not in tags_of(r)]
        assert len(parents) == 1
        parent = parents[0]
        children = [r for r in runs
                    if tags_of(r).get("mlflow.parentRunId") == parent["info"]["run_id"]]
        params = [{p["key"]: p["value"] for p in r["data"]["params"]} for r in children]
        assert sorted(p["method.name"] for p in params) == ["ar", "chain", "chain", "salf",
                                                            "tree"]
        assert {p["method.gamma"] for p in params if p["method.name"] == "chain"} == {"2", "4"}
        keys = {tuple(sorted(m["key"] for m in r["data"]["metrics"])) for r in children}
        assert len(keys) == 1, keys
        assert {"tau", "tau_std", "tokens_per_s", "speedup", "speedup_std",
                "target_calls_per_token", "acceptance_rate", "measured_over_predicted",
                "accept_at_1"} <= set(next(iter(keys)))
        assert all(r["info"]["status"] == "FINISHED" for r in children)
        pm = {m["key"] for m in parent["data"]["metrics"]}
        assert {"best_speedup", "best_tau", "best_tokens_per_s"} <= pm, pm
        arts = requests.get(f"{api}/artifacts/list", params={
            "run_id": parent["info"]["run_id"]}, timeout=10).json()["files"]
        assert {"results.csv", "tau_per_method.png", "acceptance_per_position.png",
                "speedup_per_method.png"} <= {a["path"] for a in arts}
    finally:  # `speclab ui` and the mlflow server it runs: its whole process group
        stop_process_tree(proc, grace=30)
    out = proc.stdout.read()
    assert (f"{base}/#/experiments/{exp['experiment_id']}/runs?workflowType=machine_learning"
            in out), out[-2000:]

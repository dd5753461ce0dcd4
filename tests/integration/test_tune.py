"""jobs.tune end to end on local Ray: decoding sweeps in MLflow, the best config through
evaluate, failing trials, an interrupted sweep resumed, bad sweeps refused before Ray.
The sweeps that train drafters are in test_tune_training.py (a file of their own, so the
two test processes of `make test` share the sweeps' time)."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest
import yaml

from tests.integration.conftest import ROOT, python, run_cmd, stop_process_tree

pytestmark = pytest.mark.integration
SMOKE = "experiments/smoke/tune.yaml"


def _runs(tracking_uri: str, experiment: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    return client, parent, children


def test_decode_sweep_logs_parent_children_and_a_runnable_best_config(job_env, tmp_path):
    storage = tmp_path / "runs"
    res = run_cmd([python(), "-m", "jobs.tune", "--config", SMOKE, "tracking.experiment=tu",
                   f"output.storage_path={storage}", "output.run_name=sw"], job_env)
    assert res.returncode == 0, res.stderr[-3000:]
    client, parent, children = _runs(job_env["MLFLOW_TRACKING_URI"], "tu")
    assert len(children) == 6
    assert {c.info.run_name for c in children} == {  # named by their swept values
        f"{m} nodes={n}" for m in ("tree", "salf") for n in (4, 6, 8)}
    for c in children:
        assert c.data.tags["status"] == "ok"
        assert {"predicted_speedup", "speedup", "tau", "objective"} <= set(c.data.metrics)
        assert c.data.params  # the trial's swept values
    assert parent.data.metrics["trials"] == 6 and parent.data.metrics["failed_trials"] == 0
    best = max(c.data.metrics["predicted_speedup"] for c in children)
    assert parent.data.metrics["best_predicted_speedup"] == pytest.approx(best)
    arts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"best_config.yaml", "sweep_results.csv", "search_space.yaml",
            "predicted_speedup_vs_method_nodes.png"} <= arts, arts
    best_cfg = storage / "sw" / "best_config.yaml"
    data = yaml.safe_load(best_cfg.read_text())
    assert data["job"] == "evaluate" and "sweep" not in data
    ev = run_cmd([python(), "-m", "jobs.evaluate", "--config", str(best_cfg),
                  "tracking.experiment=best"], job_env)
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert "True" in ev.stdout  # greedy output identical to AR


def test_medusa_sweep_over_tree_size_and_typical_epsilon(job_env, tmp_path, monkeypatch):
    """A decode sweep of Medusa's sparse-tree size x typical acceptance's epsilon at
    T=0.7 (``decoding.verify_params``), with heads from a folder."""
    from speclab.families.medusa.model import save_medusa
    from speclab.models.registry import ensure_tiny_pair
    from tests.unit.test_medusa import _train

    monkeypatch.setenv("SPECLAB_HOME", job_env["SPECLAB_HOME"])
    target, _ = ensure_tiny_pair()
    heads, _ = _train(target, 40)
    folder = save_medusa(heads, tmp_path / "heads", heads.tree)
    res = run_cmd([python(), "-m", "jobs.tune", "--config", SMOKE, "tracking.experiment=tm",
                   f"output.storage_path={tmp_path / 'runs'}",
                   f"method={{name: medusa, medusa_model: {folder}, nodes: 8}}",
                   "decoding.temperature=0.7", "decoding.verify=typical",
                   "decoding.verify_params={epsilon: 0.09, delta: 0.3}",
                   "sweep.space={method.nodes: {grid: [4, 8]}, "
                   "decoding.verify_params.epsilon: {grid: [0.05, 0.3]}}",
                   "sweep.metric=speedup"], job_env)
    assert res.returncode == 0, res.stderr[-3000:]
    _, parent, children = _runs(job_env["MLFLOW_TRACKING_URI"], "tm")
    seen = {(c.data.params["method.nodes"], c.data.params["decoding.verify_params.epsilon"])
            for c in children}
    assert seen == {("4", "0.05"), ("4", "0.3"), ("8", "0.05"), ("8", "0.3")}
    assert all(c.data.tags["status"] == "ok" and c.data.metrics["tau"] >= 1.0
               for c in children)
    assert parent.data.metrics["failed_trials"] == 0
    bad = run_cmd([python(), "-m", "jobs.tune", "--config", SMOKE, "tracking.experiment=tb",
                   f"output.storage_path={tmp_path / 'runs'}",
                   f"method={{name: medusa, medusa_model: {folder}}}",
                   "decoding.temperature=0.7", "decoding.verify=typical",
                   "decoding.verify_params={epsilon: -1}",
                   "sweep.space={method.nodes: {grid: [4, 8]}}"], job_env)
    assert bad.returncode == 2 and "epsilon" in bad.stderr


def test_failing_trials_are_recorded_and_the_sweep_goes_on(job_env, tmp_path):
    """salf with batch 20 > nodes 8 is an invalid combination: those trials fail with
    the field named; the other trials succeed. A swept knob that one of the swept
    methods lacks (chain has no batch) is refused before any work."""
    res = run_cmd([python(), "-m", "jobs.tune", "--config", SMOKE, "tracking.experiment=tf",
                   f"output.storage_path={tmp_path / 'runs'}",
                   "sweep.space={method.name: {grid: [optimal, salf]}, "
                   "method.batch: {grid: [2, 20]}}"], job_env)
    assert res.returncode == 0, res.stderr[-3000:]
    _, parent, children = _runs(job_env["MLFLOW_TRACKING_URI"], "tf")
    status = {(c.data.params["method.name"], c.data.params["method.batch"]):
              c.data.tags["status"] for c in children}
    assert status == {("optimal", "2"): "ok", ("optimal", "20"): "failed",
                      ("salf", "2"): "ok", ("salf", "20"): "failed"}
    failed = next(c for c in children if c.data.tags["status"] == "failed")
    assert "batch (20) must not exceed nodes (8)" in failed.data.tags["error"]
    assert parent.data.metrics["failed_trials"] == 2
    assert "'method.batch': 20" not in parent.data.tags["best_params"]


def test_interrupted_sweep_resumes_without_rerunning_finished_trials(job_env, tmp_path):
    storage = tmp_path / "runs"
    args = [python(), "-m", "jobs.tune", "--config", SMOKE, "tracking.experiment=tr",
            f"output.storage_path={storage}", "output.run_name=rs", "sweep.max_concurrent=1"]
    starts = storage / "rs" / "trial_starts.jsonl"
    proc = subprocess.Popen(args, cwd=ROOT, env=job_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline:  # two trials finished, the third running
            if starts.exists() and len(starts.read_text().splitlines()) >= 3:
                break
            if proc.poll() is not None:
                pytest.fail("sweep ended before the interrupt: " + proc.stdout.read()[-3000:])
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)  # Tune stops gracefully and saves its state
        proc.communicate(timeout=180)
    finally:  # whatever the job left of its process tree (its embedded Ray), and only that
        stop_process_tree(proc, grace=30)
    before = [json.loads(x)["params"] for x in starts.read_text().splitlines()]
    res = run_cmd(args + ["train.resume=true"], job_env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "restoring the sweep" in res.stdout
    after = [json.loads(x)["params"] for x in starts.read_text().splitlines()][len(before):]
    finished = before[:-1]  # the last one was cut off by the interrupt
    assert not [p for p in after if p in finished], (before, after)
    assert len(finished) + len(after) == 6  # every trial ran exactly once to the end
    _, parent, children = _runs(job_env["MLFLOW_TRACKING_URI"], "tr")
    resumed = [r for r in [parent] if r.data.metrics.get("trials") == 6]
    assert resumed and all(c.data.tags["status"] == "ok" for c in children
                           if c.data.tags["mlflow.parentRunId"] == resumed[0].info.run_id)


def test_eagle_sweep_needs_the_eagle_method(job_env, tmp_path):
    res = run_cmd([python(), "-m", "jobs.tune", "--config", "experiments/sweeps/eagle_smoke.yaml",
                   "method={name: chain}", f"output.storage_path={tmp_path / 'runs'}"],
                  job_env, timeout=120)
    assert res.returncode == 2 and "method.name" in res.stderr, res.stderr[-2000:]
    assert "running on" not in res.stdout


def test_unknown_swept_field_fails_before_ray(job_env, tmp_path):
    res = run_cmd([python(), "-m", "jobs.tune", "--config", SMOKE,
                   "sweep.space={method.gama: {grid: [2, 3]}}",
                   f"output.storage_path={tmp_path / 'runs'}"], job_env, timeout=120)
    assert res.returncode == 2 and "'method.gama' is not a field" in res.stderr
    assert "running on" not in res.stdout

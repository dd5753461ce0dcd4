"""jobs.tune end to end on local Ray: decoding and training sweeps in MLflow, the best
config through evaluate, failing trials, and an interrupted sweep resumed."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

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


def test_head_training_sweep_with_asha(job_env, tmp_path):
    """4 training trials (head depth x w_rej) with ASHA on the validation loss reported
    every 10 steps; each surviving trial then decodes with specdecpp at threshold h."""
    res = run_cmd([python(), "-m", "jobs.tune", "--config",
                   "experiments/sweeps/head_smoke.yaml", "tracking.experiment=th",
                   f"output.storage_path={tmp_path / 'runs'}"], job_env, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    _, parent, children = _runs(job_env["MLFLOW_TRACKING_URI"], "th")
    assert len(children) == 4 and parent.data.metrics["trials"] == 4
    done = [c for c in children if "objective" in c.data.metrics]
    assert done and all(c.data.tags["status"] == "ok" for c in done)
    for c in done:  # trained, then evaluated with the adaptive drafter (lossless)
        m = c.data.metrics
        assert m["identical_to_ar"] == 1.0 and m["step"] == 30 and "heldout_ece" in m
    stopped = [c for c in children if "objective" not in c.data.metrics]
    for c in stopped:  # stopped early by ASHA after an intermediate report
        assert c.data.metrics["step"] < 30 and c.data.tags["status"] == "stopped"
    assert Path(parent.data.tags["best_config"]).exists()


@pytest.mark.parametrize("config,kind", [("experiments/sweeps/eagle3_smoke.yaml", "feat3")])
def test_eagle_training_sweep_over_hass_knobs(job_env, tmp_path, config, kind):
    """2 trials each train an EAGLE-3 drafter (ttt_steps 1 / 2) with Ray Train in two
    chunks, report val_top1 and the engine's tau, then decode method eagle with their
    own drafter (lossless); the best config evaluates the best trial's drafter. The
    HASS-knob sweep (experiments/sweeps/eagle_smoke.yaml: hass_k 1 / 2) runs the same
    job code with the feat data kind; it is not run here to keep CI within its time
    (its config is checked by test_eagle_sweep_needs_the_eagle_method and the layout
    tests)."""
    storage = tmp_path / "runs"
    res = run_cmd([python(), "-m", "jobs.tune", "--config", config, "tracking.experiment=te",
                   f"output.storage_path={storage}", "output.run_name=es"], job_env,
                  timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    _, parent, children = _runs(job_env["MLFLOW_TRACKING_URI"], "te")
    assert len(children) == 2 and parent.data.metrics[f"shards.{kind}"] == 2
    assert parent.data.metrics["t_draft_s"] > 0  # the EAGLE drafter's forward, timed
    for c in children:
        m = c.data.metrics
        assert c.data.tags["status"] == "ok" and m["step"] == 8, m
        assert m["identical_to_ar"] == 1.0 and 0 <= m["val_top1"] <= 1 and m["engine_tau"] >= 1
        assert m["predicted_speedup"] > 0
    best = yaml.safe_load((storage / "es" / "best_config.yaml").read_text())
    assert best["job"] == "evaluate" and best["method"]["name"] == "eagle"
    assert Path(best["method"]["eagle_model"], "config.json").exists()


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


def test_atspeed_alpha_n_sweep_trains_drafters_and_writes_a_recommend_eval_config(
        job_env, tmp_path):
    """The AtSpeed alpha x N sweep at toy size (one alpha, two N: the sweep's machinery,
    not its grid, costs CI time): 2 trials each train an AtSpeed-R drafter
    (Ray Train, two chunks for ASHA), report AS@K / WS@K; the best config re-runs the
    best trial's drafter through recommend_eval without training anything."""
    storage = tmp_path / "runs"
    res = run_cmd([python(), "-m", "jobs.tune", "--config",
                   "experiments/sweeps/atspeed_alpha_n.yaml", "tracking.experiment=ta",
                   "rec.users=150", "rec.items=120", "train.steps=40", "train.report_every=20",
                   "rec_eval.draft_steps=40", "rec_eval.align_examples=100",
                   "rec_eval.test_users=6", f"output.storage_path={storage}",
                   "output.run_name=at", "sweep.space={rec_eval.align_alpha: {grid: [0.5]}, "
                   "rec_eval.ns: {grid: [[3], [6]]}}"], job_env)
    assert res.returncode == 0, res.stderr[-3000:]
    client, parent, children = _runs(job_env["MLFLOW_TRACKING_URI"], "ta")
    trials = [c for c in children if c.data.tags.get("status")]  # not the target's run
    assert len(trials) == 2
    for c in trials:
        assert c.data.tags["status"] == "ok"
        m = c.data.metrics
        assert 0 < m["as_at_k"] <= 4 and m["ws_at_k"] > 0 and m["val_loss"] > 0
        assert m["K"] == (3 if c.data.params["rec_eval.ns"] == "[3]" else 5)
    assert parent.data.metrics["best_as_at_k"] == max(c.data.metrics["as_at_k"] for c in trials)
    data = yaml.safe_load((storage / "at" / "best_config.yaml").read_text())
    assert data["job"] == "recommend_eval"
    (name, drafter), = data["rec_eval"]["drafts"].items()
    assert name.startswith("atspeed_r@") and (Path(drafter) / "config.json").exists()
    ev = run_cmd([python(), "-m", "jobs.recommend_eval", "--config",
                  str(storage / "at" / "best_config.yaml"), "tracking.experiment=tab"], job_env)
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert name in ev.stdout and "[rec] model saved" not in ev.stdout  # nothing retrained

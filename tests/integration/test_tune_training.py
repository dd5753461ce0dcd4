"""jobs.tune end to end on local Ray, the sweeps that train: SpecDec++ heads under ASHA,
EAGLE-3 drafters over training knobs, AtSpeed drafters over alpha x N; each best config
re-runs what its best trial trained."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.integration.conftest import python, run_cmd
from tests.integration.test_tune import _runs

pytestmark = pytest.mark.integration


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

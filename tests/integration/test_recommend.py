"""AtSpeed through the user's paths: jobs.train_recommender -> MLflow registry ->
`speclab recommend` (beam vs strict beam SD, identical items), and bad input."""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import find_run, python, run_cmd

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    import os
    import sys
    from pathlib import Path

    tmp = tmp_path_factory.mktemp("rec")
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.update({"SPECLAB_HOME": str(tmp / "home"),
                "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}",
                "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"})
    res = run_cmd([python(), "-m", "jobs.train_recommender", "--config",
                   "experiments/smoke/train_recommender.yaml",
                   f"output.storage_path={tmp / 'runs'}"], env)
    assert res.returncode == 0, res.stderr[-3000:]
    return env, tmp


def recommend(env, *args):
    return run_cmd([python(), "-m", "speclab.cli", "recommend",
                    "--target", "models:/speclab-smoke-recommender/1", *args], env)


def test_strict_sd_from_the_registry_equals_beam_search(trained):
    env, _ = trained
    _, run = find_run(env["MLFLOW_TRACKING_URI"], "speclab-smoke")
    assert run.data.metrics["final_step"] == 30
    for history in ("3,17,42", "5", "100,7,8,9,10,11,12"):
        beam = recommend(env, "--history", history, "--k", "5", "--json")
        assert beam.returncode == 0, beam.stderr[-2000:]
        sd = recommend(env, "--draft", "models:/speclab-smoke-recommender/1", "--method", "sd",
                       "--history", history, "--k", "5", "--n", "8", "--gamma", "2", "--json")
        assert sd.returncode == 0, sd.stderr[-2000:]
        b, s = json.loads(beam.stdout), json.loads(sd.stdout)
        assert b["items"] == s["items"] and len(b["items"]) == 5
        assert all(0 <= i < 120 for i in b["items"])  # dataset item ids
        assert s["stats"]["accepted_steps"] >= 1  # the draft is the target itself here


@pytest.mark.parametrize("args,message", [
    (["--history", "3,999999"], "history: unknown item id(s) [999999]"),
    (["--history", ""], "history: must contain at least one item"),
    (["--history", "3", "--method", "sd", "--draft", "models:/speclab-smoke-recommender/1",
      "--k", "9", "--n", "4"], "k: must not exceed the draft beam size n=4"),
    (["--history", "3", "--k", "0"], "k: must be in"),
])
def test_bad_input(trained, args, message):
    env, _ = trained
    res = recommend(env, *args)
    assert res.returncode == 2 and message in res.stderr, res.stderr[-1500:]


def test_id_length_mismatch_is_reported(trained):
    env, tmp = trained
    from pathlib import Path

    model = next(Path(tmp / "runs").glob("*/model"))
    meta = json.loads((model / "rec_meta.json").read_text())
    meta["levels"] = 3
    meta["codes"] = [c[:3] for c in meta["codes"]]
    (model / "rec_meta.json").write_text(json.dumps(meta))
    res = run_cmd([python(), "-m", "speclab.cli", "recommend", "--target", str(model),
                   "--history", "3"], env)
    assert res.returncode == 2 and "does not match the item ids" in res.stderr

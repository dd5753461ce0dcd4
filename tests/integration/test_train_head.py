"""jobs.train_head end to end: data on Ray actors, head on Ray Train, MLflow registry;
then the engine loads drafter + head from the registry (API and CLI); bad input."""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import find_run, python, refused_before_work, run_cmd

pytestmark = pytest.mark.integration
SMOKE = "experiments/smoke/train_head.yaml"


def test_head_trained_registered_and_used_by_the_engine(job_env, tmp_path, monkeypatch):
    res = run_cmd([python(), "-m", "jobs.train_head", "--config", SMOKE,
                   f"output.storage_path={tmp_path / 'runs'}", "tracking.experiment=h"], job_env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "registered as models:/speclab-smoke-head/1" in res.stdout
    client, run = find_run(job_env["MLFLOW_TRACKING_URI"], "h")
    m = run.data.metrics
    assert m["shards"] == 3 and m["final_step"] == 40  # 48 prompts in shards of 16
    for key in ("heldout_ece", "heldout_accuracy", "heldout_bce", "val_loss", "loss"):
        assert key in m, sorted(m)
    assert 0.0 <= m["heldout_ece"] <= 1.0 and 0.0 <= m["heldout_accuracy"] <= 1.0
    assert [h.step for h in client.get_metric_history(run.info.run_id, "loss")] == [20, 40]

    from speclab.api import Decoder
    from speclab.models.registry import ensure_tiny_pair

    monkeypatch.setenv("MLFLOW_TRACKING_URI", job_env["MLFLOW_TRACKING_URI"])
    monkeypatch.setenv("SPECLAB_HOME", job_env["SPECLAB_HOME"])
    target, _ = ensure_tiny_pair()
    uri = "models:/speclab-smoke-head/1"
    dec = Decoder.from_pretrained(target, uri)
    ar = dec.generate("def f(x):", method="ar", max_new_tokens=24)
    sd = dec.generate("def f(x):", method="specdecpp", head=uri, stop_threshold=0.5,
                      max_new_tokens=24)
    assert sd.token_ids == ar.token_ids  # lossless: the head only picks lengths
    assert sd.stats.drafted_tokens > 0 and sd.stats.target_calls < 24

    cli = run_cmd([python(), "-m", "speclab.cli", "generate", "--target", target, "--draft", uri,
                   "--method", "specdecpp", "--head", uri, "--stop-threshold", "0.3",
                   "--prompt", "def f(x):", "--max-new-tokens", "24", "--json"], job_env)
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert json.loads(cli.stdout.strip().splitlines()[-1])["token_ids"] == ar.token_ids
    bad = run_cmd([python(), "-m", "speclab.cli", "generate", "--target", target, "--draft", uri,
                   "--method", "specdecpp", "--head", uri, "--stop-threshold", "1.5",
                   "--prompt", "def f(x):"], job_env)
    assert bad.returncode == 2 and "stop_threshold: Input should be less than 1" in bad.stderr
    old = run_cmd([python(), "-m", "speclab.cli", "generate", "--target", target, "--draft", uri,
                   "--method", "specdecpp", "--head", uri, "--threshold", "0.3",
                   "--prompt", "def f(x):"], job_env)
    assert old.returncode == 2 and "threshold: renamed: use --stop-threshold" in old.stderr


@pytest.mark.parametrize("overrides,message", [
    (["head.w_rej=-1"], "head.w_rej"),
    (["head.mix_ratio=1.5"], "head.mix_ratio"),
    (["models.target=/nonexistent/target"], "models.draft: the acceptance head needs a drafter"),
    (["models.target=/nonexistent/target", "models.draft=/nonexistent/draft"], "models.target"),
])
def test_bad_input_fails_before_ray(job_env, tmp_path, overrides, message):
    refused_before_work("train_head", SMOKE, overrides, message, job_env, tmp_path / "runs")

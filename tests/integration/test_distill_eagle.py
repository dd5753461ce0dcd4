"""jobs.distill_eagle end to end: target features on Ray actors, the EAGLE drafter on Ray
Train, the MLflow registry, then `speclab generate --method eagle` with the registered
drafter (lossless); bad input before any work."""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import (
    find_run,
    method_children,
    python,
    refused_before_work,
    run_cmd,
)

pytestmark = pytest.mark.integration
CONFIG = "experiments/smoke/distill_eagle.yaml"


@pytest.mark.parametrize("config,name,kind", [
    (CONFIG, "speclab-smoke-eagle", "feat"),
    ("experiments/smoke/distill_eagle3.yaml", "speclab-smoke-eagle3", "feat3")])
def test_eagle_drafter_trained_registered_and_served_by_the_cli(job_env, tmp_path,
                                                               monkeypatch, config, name, kind):
    """EAGLE (HASS loss) and EAGLE-3 (fused layer features over the target's own text, a
    128-token draft vocabulary, the training-time test): trained, registered, evaluated,
    then decoded by the CLI from the registry (the CLI reads an EAGLE-3 drafter's layers
    from its folder)."""
    res = run_cmd([python(), "-m", "jobs.distill_eagle", "--config", config,
                   f"output.storage_path={tmp_path / 'runs'}", "tracking.experiment=e"],
                  job_env)
    assert res.returncode == 0, res.stderr[-3000:]
    uri = f"models:/{name}/1"
    assert f"registered as {uri}" in res.stdout
    client, run = find_run(job_env["MLFLOW_TRACKING_URI"], "e")
    m = run.data.metrics
    assert m["final_step"] == 20 and m[f"shards.{kind}"] == 2 and 0 <= m["final_val_top1"] <= 1
    # the EAGLE-3 smoke trains on the target's own text (eagle.data: target), stamped in
    # its shards' plan
    plans = list((tmp_path / "runs").rglob(f"{kind}/plan.json"))
    assert len(plans) == 1, plans
    plan = json.loads(plans[0].read_text())
    assert (plan.get("data"), run.data.params["eagle.data"]) == (
        ("target", "target") if kind == "feat3" else (None, "corpus")), plan
    assert m["loss"] < 1e4, m  # the workers' loss (DDP-wrapped drafter) is finite
    for key in ("val_top1", "engine_tau", "engine_accept_at_1"):  # next to the loss curve
        assert [h.step for h in client.get_metric_history(run.info.run_id, key)] == [10, 20]
    assert m["engine_tau"] >= 1.0 and m["final_engine_tau"] == m["engine_tau"]
    evals = method_children(client, run)
    assert "eagle-salf" in evals, sorted(evals)
    assert all(c.data.metrics["identical_to_ar"] == 1.0 for c in evals.values())
    assert client.get_model_version(name, "1").run_id == run.info.run_id

    from speclab.api import Decoder
    from speclab.models.registry import ensure_tiny_pair

    monkeypatch.setenv("MLFLOW_TRACKING_URI", job_env["MLFLOW_TRACKING_URI"])
    monkeypatch.setenv("SPECLAB_HOME", job_env["SPECLAB_HOME"])
    target, _ = ensure_tiny_pair()
    ar = Decoder.from_pretrained(target).generate("def f(x):", method="ar",
                                                   max_new_tokens=16)
    cli = run_cmd([python(), "-m", "speclab.cli", "generate", "--target", target,
                   "--method", "eagle", "--eagle-model", uri, "--builder", "salf",
                   "--prompt", "def f(x):", "--max-new-tokens", "16", "--json"], job_env)
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert json.loads(cli.stdout.strip().splitlines()[-1])["token_ids"] == ar.token_ids


@pytest.mark.parametrize("overrides,message", [
    (["eagle.hass_k=8"], "eagle.hass_k (8) must not exceed distill.top_k (4)"),
    (["eagle.loss=medusa"], "eagle.loss"),
    (["eagle.w_cls=-1"], "eagle.w_cls"),
    (["methods=[{name: eagle, builder: beam}]"], "builder"),
    (["eagle.version=3"], "eagle: loss: 'hass' regresses"),
    (["eagle.version=3", "eagle.loss=eagle3", "eagle.draft_vocab=100000"],
     "eagle.draft_vocab: 100000 is not in [0,"),
    (["eagle.version=3", "eagle.loss=eagle3", "eagle.feature_layers=[1, 99]"],
     "eagle.feature_layers: layer indices [99]"),
    (["eagle.data=target", "eagle.data_prompt=32"],
     "eagle.data_prompt (32) must be below distill.seq_len (32)"),
])
def test_bad_input_fails_before_work(job_env, tmp_path, overrides, message):
    refused_before_work("distill_eagle", CONFIG, overrides, message, job_env,
                        tmp_path / "runs")

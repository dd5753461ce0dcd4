"""jobs.train_medusa end to end: self-distillation data on Ray actors, MEDUSA-1 and MEDUSA-2
on Ray Train (one MLflow child run each, engine figures next to the loss), calibrated
heads with their sparse tree, the registry, MEDUSA-2's new target and its quality report,
then `speclab generate --method medusa` with the registered heads (lossless); bad input
before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.conftest import method_children, python, refused_before_work, run_cmd

pytestmark = pytest.mark.integration
CONFIG = "experiments/smoke/train_medusa.yaml"


def test_medusa_heads_trained_calibrated_registered_and_used_by_the_cli(job_env, tmp_path,
                                                                       monkeypatch):
    from mlflow.tracking import MlflowClient

    res = run_cmd([python(), "-m", "jobs.train_medusa", "--config", CONFIG,
                   f"output.storage_path={tmp_path / 'runs'}", "tracking.experiment=m"],
                  job_env)
    assert res.returncode == 0, res.stderr[-3000:]
    for variant in ("medusa1", "medusa2"):
        assert f"registered as models:/speclab-smoke-medusa-{variant}/1" in res.stdout
    client = MlflowClient(job_env["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("m")
    runs = client.search_runs([exp.experiment_id])
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    children = {r.data.tags["variant"]: r for r in runs
                if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert sorted(children) == ["medusa1", "medusa2"]
    assert all(r.data.tags["mlflow.parentRunId"] == parent.info.run_id
               for r in children.values())
    assert parent.data.metrics["shards.medusa"] == 2
    for run in children.values():
        m = run.data.metrics
        assert m["final_step"] == 12
        for key in ("val_head1_top1", "engine_tau", "engine_accept_at_1"):  # next to loss
            assert [h.step for h in client.get_metric_history(run.info.run_id, key)] == [6, 12]
        assert m["engine_identical"] == 1.0
        evals = method_children(client, run)  # each variant's methods: child runs
        assert all(c.data.metrics["identical_to_ar"] == 1.0 for c in evals.values())
        assert any(k.startswith("medusa-sparse") for k in evals), sorted(evals)
        assert m["expected_tau.sparse_8"] >= m["expected_tau.chain"] >= 1.0
        assert m["replayed_tau.sparse_8"] >= 1.0 and m["replayed_tau.chain"] >= 1.0
    q = children["medusa2"].data.metrics
    assert q["quality.ppl_original"] > 1 and q["quality.ppl_tuned"] > 1
    assert 0 <= q["quality.top1_agreement"] <= 1
    assert not any(k.startswith("quality.") for k in children["medusa1"].data.metrics)
    table = json.loads(Path(client.download_artifacts(
        parent.info.run_id, "medusa_comparison.json", str(tmp_path))).read_text())
    assert {(r["variant"], r["method"]) for r in table} == {
        (v, t) for v in ("medusa1", "medusa2")
        for t in ("medusa-chain", "medusa-cartesian", "medusa-sparse")}

    heads2 = next((tmp_path / "runs").glob("*-medusa2")) / "medusa"
    tree = json.loads((heads2 / "tree.json").read_text())
    assert len(tree["sparse"]) == 8 and len(tree["accuracies"]) == 3
    # calibrated on held-out function headers continued by the variant's target
    assert tree["calibration"] == "prompts" and tree["calibration_sequences"] == 6
    meta = json.loads((heads2 / "config.json").read_text())
    assert meta["target"].endswith("-medusa2/target") and Path(meta["target"]).is_dir()

    from speclab.api import Decoder
    from speclab.models.registry import ensure_tiny_pair

    monkeypatch.setenv("MLFLOW_TRACKING_URI", job_env["MLFLOW_TRACKING_URI"])
    monkeypatch.setenv("SPECLAB_HOME", job_env["SPECLAB_HOME"])
    target, _ = ensure_tiny_pair()
    ar = Decoder.from_pretrained(target).generate("def f(x):", method="ar",
                                                   max_new_tokens=16)
    cli = run_cmd([python(), "-m", "speclab.cli", "generate", "--target", target,
                   "--method", "medusa", "--medusa-model", "models:/speclab-smoke-medusa-"
                   "medusa1/1", "--tree", "sparse", "--nodes", "6",
                   "--prompt", "def f(x):", "--max-new-tokens", "16", "--json"], job_env)
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert json.loads(cli.stdout.strip().splitlines()[-1])["token_ids"] == ar.token_ids
    # MEDUSA-2 heads belong to the fine-tuned target, not to the original
    wrong = run_cmd([python(), "-m", "speclab.cli", "generate", "--target", target,
                     "--method", "medusa", "--medusa-model", str(heads2),
                     "--prompt", "def f(x):", "--max-new-tokens", "4"], job_env)
    assert wrong.returncode == 2 and "medusa_model: heads trained for target" in wrong.stderr
    new_target = meta["target"]
    ar2 = Decoder.from_pretrained(new_target).generate("def f(x):", method="ar",
                                                       max_new_tokens=16)
    ok = Decoder.from_pretrained(new_target).generate(
        "def f(x):", method="medusa", medusa_model=str(heads2), max_new_tokens=16)
    assert ok.token_ids == ar2.token_ids


@pytest.mark.parametrize("overrides,message", [
    (["medusa.heads=0"], "medusa.heads"),
    (["medusa.variants=[medusa3]"], "medusa.variants"),
    (["distill.prompt_len=2", "distill.response_len=2"],
     "must exceed medusa.heads + 1"),
    (["methods=[{name: medusa, tree: dense}]"], "tree"),
])
def test_bad_input_fails_before_work(job_env, tmp_path, overrides, message):
    refused_before_work("train_medusa", CONFIG, overrides, message, job_env,
                        tmp_path / "runs")


def test_calibration_prompts_missing_fail_before_work(job_env, tmp_path):
    """``medusa.calibration: prompts`` with a JSONL set holding only the evaluated prompts
    is refused before any data is generated or any head trained, naming the field."""
    path = tmp_path / "two.jsonl"
    path.write_text('{"prompt": "def f(x):"}\n{"prompt": "class A:"}\n')
    refused_before_work("train_medusa", CONFIG,
                        ["data.prompts=jsonl", f"data.path={path}", "data.num_prompts=2"],
                        "medusa.calibration: 'prompts' needs prompts in data.path", job_env,
                        tmp_path / "runs")

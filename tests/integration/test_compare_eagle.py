"""jobs.compare_eagle end to end: feat, feat_tree, feat3 and feat3_tree shards generated
once (the EAGLE-3 kinds with compare.eagle3's layers), an EAGLE and an EAGLE-3 base
drafter, EAGLE and TALF fine-tuned from the first and EAGLE-3 + TALF from the second on
Ray Train, each a child run with its own registered drafter, and the row x method table
with acceptance per draft position on the parent run; bad input before any work."""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import method_children, python, refused_before_work, run_cmd

pytestmark = pytest.mark.integration
CONFIG = "experiments/smoke/compare_eagle.yaml"


def test_eagle_losses_compared_as_child_runs(job_env, tmp_path):
    from mlflow.tracking import MlflowClient

    res = run_cmd([python(), "-m", "jobs.compare_eagle", "--config", CONFIG,
                   f"output.storage_path={tmp_path / 'runs'}", "tracking.experiment=ce"],
                  job_env)
    assert res.returncode == 0, res.stderr[-3000:]
    client = MlflowClient(job_env["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([client.get_experiment_by_name("ce").experiment_id])
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    children = {r.data.tags["loss"] + r.data.tags.get("stage", ""): r for r in runs
                if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert sorted(children) == ["eagle3_talf", "eagle3base", "eaglebase", "talf"]
    for kind in ("feat", "feat_tree", "feat3_tree", "feat3"):
        assert parent.data.metrics[f"shards.{kind}"] == 2
    for kind in ("feat3", "feat3_tree"):  # made with the EAGLE-3 rows' layers
        plan, = (tmp_path / "runs").rglob(f"data/{kind}/plan.json")
        assert json.loads(plan.read_text())["feature_layers"] == [1, 2]
    assert children["eaglebase"].data.metrics["final_step"] == 10
    assert children["eagle3base"].data.metrics["final_step"] == 10
    for loss in ("talf", "eagle3_talf"):  # from their base, compare.finetune_steps
        m = children[loss].data.metrics
        assert m["final_step"] == 6 and m["engine_tau"] >= 1.0, m
        evals = method_children(client, children[loss])
        assert all(c.data.metrics["identical_to_ar"] == 1.0 for c in evals.values())
        assert 0.0 <= evals["eagle-salf"].data.metrics["accept_at_1"] <= 1.0
        version = client.get_model_version(f"speclab-smoke-compare-eagle-{loss}", "1")
        assert version.run_id == children[loss].info.run_id
    arts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"loss_comparison.csv", "loss_comparison.txt", "tau_by_loss.png",
            "acceptance_per_position.png"} <= arts, arts
    rows = [ln.split() for ln in res.stdout.splitlines()]
    assert {(r[0], r[1]) for r in rows if r[:2] in (["talf", "eagle-salf"],
                                                     ["eagle3_talf", "eagle-salf"])} == {
        ("talf", "eagle-salf"), ("eagle3_talf", "eagle-salf")}


@pytest.mark.parametrize("overrides,message", [
    (["compare.losses=[eagle,medusa]"], "compare.losses"),
    (["eagle.init_from=/nonexistent/drafter"], "eagle.init_from"),
    (["eagle.talf_depth=30"], "eagle.talf_depth (30) must be below distill.seq_len (24)"),
    (["compare.bases={eagle3: /nonexistent/drafter}"], "compare.bases.eagle3"),
    (["compare.eagle3={draft_vocab: -1}"], "compare.eagle3 (row 'eagle3_talf')"),
])
def test_bad_input_fails_before_work(job_env, tmp_path, overrides, message):
    refused_before_work("compare_eagle", CONFIG, overrides, message, job_env,
                        tmp_path / "runs")

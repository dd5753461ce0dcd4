"""jobs.evaluate end to end on embedded Ray, and its fail-fast paths."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import pytest
import yaml

from tests.integration.conftest import (
    ROOT,
    find_run,
    free_port,
    method_children,
    python,
    run_cmd,
)

pytestmark = pytest.mark.integration
SMOKE = "experiments/smoke/evaluate.yaml"


def check_evaluate_run(tracking_uri: str, experiment: str = "speclab-smoke",
                       ray_job: str | None = None) -> None:
    """One parent run (config, table, plots, best_*) and one child run per method, AR
    included, with the method's settings as params and identical metric keys;
    ``ray_job``: the Ray Jobs submission id its ``ray_job_id`` tag must hold."""
    client, run = find_run(tracking_uri, experiment)
    if ray_job is not None:
        assert run.data.tags.get("ray_job_id") == ray_job, run.data.tags
    assert run.info.status == "FINISHED"
    m = run.data.metrics
    assert {"best_speedup", "best_tau", "best_tokens_per_s", "prompts"} <= set(m), sorted(m)
    assert not any("." in k for k in m), sorted(m)  # no more "<method>.<metric>" keys
    assert run.data.params["methods.0.gamma"] == "2"
    assert run.data.tags["git_commit"] and run.data.tags["config_hash"]
    assert "evaluate" in run.data.tags["command"]  # how it was started
    assert m["summary/best_speedup"] == m["best_speedup"]  # the chart view leads with these
    [ds] = run.inputs.dataset_inputs  # the prompt set, in the runs page's Datasets column
    assert ds.dataset.name.startswith("stdlib_functions") and \
        ds.tags[0].value == "evaluation"
    note = run.data.tags["mlflow.note.content"]  # the run page's description
    assert note.startswith("**Best speedup") and "| method | tau |" in note, note
    assert "| chain(gamma=2) |" in note
    children = method_children(client, run)
    assert sorted(children) == sorted(["ar", "chain(gamma=2)", "chain(gamma=4)",
                                       *(k for k in children if k.startswith(("tree(", "salf(")))])
    assert len(children) == 5, sorted(children)
    chain = children["chain(gamma=2)"]
    assert chain.data.params["method.name"] == "chain"
    assert chain.data.params["method.gamma"] == "2"
    assert chain.info.run_name == "chain(gamma=2)"  # nested under the parent in the UI
    cm = chain.data.metrics
    for key in ("tau", "tau_std", "tokens_per_s", "tokens_per_s_std", "speedup",
                "speedup_std", "target_calls_per_token", "acceptance_rate",
                "measured_over_predicted", "accept_at_1"):
        assert key in cm, sorted(cm)
    assert children["ar"].data.metrics["tau"] == 1.0 and cm["tau"] >= 1.0
    assert cm["summary/tau"] == cm["tau"] and cm["summary/speedup"] == cm["speedup"]
    assert cm["tau_std"] >= 0 and cm["speedup_std"] >= 0
    # each method's run lasts its timed decoding and has a colour of its own
    assert chain.info.end_time - chain.info.start_time == max(int(cm["decode_s"] * 1000), 1)
    colours = [c.data.tags["mlflow.runColor"] for c in children.values()]
    assert len(set(colours)) == len(colours) == 5, colours
    assert m["best_tau"] == max(c.data.metrics["tau"] for k, c in children.items() if k != "ar")
    history = client.get_metric_history(chain.info.run_id, "acceptance_at_least")
    assert [h.step for h in sorted(history, key=lambda h: h.step)] == [1, 2, 3, 4, 5, 6]
    assert history[0].value == pytest.approx(cm[f"accept_at_{history[0].step}"])
    arts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "results.csv", "results.json", "tau_per_method.png",
            "tokens_per_s.png", "speedup_per_method.png", "speedup_vs_gamma.png",
            "acceptance_per_position.png", "acceptance_per_position.csv"} <= arts, arts
    exp = client.get_experiment(run.info.experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"


#: smoke configs that a test of their own runs as they are (output folder and experiment
#: aside) and checks in depth: running them again here would only double the suite's time
RUN_BY_OWN_TEST = {
    "compare_eagle": "test_compare_eagle.py", "distill": "test_distill.py",
    "distill_eagle": "test_distill_eagle.py", "distill_eagle3": "test_distill_eagle.py",
    "train_head": "test_train_head.py",
    "train_medusa": "test_train_medusa.py", "train_target": "test_train_target.py",
    "tune": "test_tune.py", "train_recommender": "test_recommend.py",
    "regenerate": "test_regenerate.py",
    "serve": "test_serve.py",  # a server, not a job
}
SMOKE_CONFIGS = sorted(p for p in (ROOT / "experiments" / "smoke").glob("*.yaml")
                       if p.stem not in RUN_BY_OWN_TEST)


def test_every_smoke_config_is_run_by_some_test():
    """Those not run below are run by the test file named in RUN_BY_OWN_TEST (which runs
    the config itself, through the job's own command)."""
    here = Path(__file__).parent
    for stem, test_file in RUN_BY_OWN_TEST.items():
        assert (ROOT / "experiments" / "smoke" / f"{stem}.yaml").exists(), stem
        text = (here / test_file).read_text()
        assert f"experiments/smoke/{stem}.yaml" in text, (stem, test_file)
        assert "jobs." in text or "speclab.cli" in text, test_file


@pytest.mark.parametrize("path", SMOKE_CONFIGS, ids=[p.name for p in SMOKE_CONFIGS])
def test_every_smoke_config_runs_end_to_end(job_env, path):
    """`python -m jobs.<job> --config experiments/smoke/<job>.yaml` on embedded Ray."""
    job = yaml.safe_load(path.read_text())["job"]
    assert path.stem == job  # experiments/smoke/<job>.yaml
    res = run_cmd([python(), "-m", f"jobs.{job}", "--config", str(path.relative_to(ROOT))],
                  job_env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "embedded local Ray" in res.stdout
    if job == "evaluate":
        assert "tau" in res.stdout and "salf(" in res.stdout  # the printed table
        assert "True" in res.stdout  # greedy outputs identical to AR
        assert "(after `speclab ui`)" in res.stdout
        out = res.stdout
        assert "[evaluate] actor 1: method 1/" in out  # progress per method, per actor
        assert "[evaluate] actor 2: models loaded, torch threads 1" in out  # resources
        assert out.rindex("[evaluate] actor ") < out.index("\nmethod ")  # then the table
        assert "\n  salf: salf(batch=2," in out  # a short label's legend
        assert "http://127.0.0.1:5000/#/experiments/" in res.stdout  # a direct link
        check_evaluate_run(job_env["MLFLOW_TRACKING_URI"])
    if job == "compare_losses":
        check_comparison_runs(job_env["MLFLOW_TRACKING_URI"])
    if job == "recommend_eval":
        check_recommend_eval_runs(job_env["MLFLOW_TRACKING_URI"], res.stdout)
    if job == "specdecpp_eval":
        check_specdecpp_runs(job_env["MLFLOW_TRACKING_URI"], res.stdout)
    if job == "build_datastore":
        check_datastore_serves_rest(job_env)
    if job == "retrieval_eval":  # every task, every method, all lossless (greedy, no relax
        for task in ("code_completion", "docstring_qa", "docstring_summary"):  # for pld)
            assert any(ln.startswith(task) and ln.split()[1].startswith("pld")
                       and ln.rstrip().endswith("True")
                       for ln in res.stdout.splitlines()), res.stdout[-3000:]
        check_retrieval_runs(job_env["MLFLOW_TRACKING_URI"])


def check_retrieval_runs(tracking_uri: str) -> None:
    """A child run per task x method (AR, pld, aasd, HF prompt lookup) with the same
    metric keys; ``<task>/best_*`` on the parent."""
    client, run = find_run(tracking_uri, "speclab-smoke")
    children = method_children(client, run)
    tasks = ("code_completion", "docstring_qa", "docstring_summary")
    assert len(children) == 12, sorted(children)
    for task in tasks:
        mine = {k: c for k, c in children.items() if k.startswith(f"{task}/")}
        assert sorted(c.data.params["method.name"] for c in mine.values()) == [
            "aasd", "ar", "hf_prompt_lookup", "pld"]
        assert all(c.data.params["method.task"] == task for c in mine.values())
        assert run.data.metrics[f"{task}/best_speedup"] > 0
    pld = next(c for k, c in children.items() if k.startswith("code_completion/pld("))
    assert pld.data.params["method.ngram"] == "10"
    assert {"tau", "speedup", "accuracy", "identical_to_ar"} <= set(pld.data.metrics)


def check_datastore_serves_rest(job_env: dict) -> None:
    """The built datastore drives `speclab generate --method rest` (lossless)."""
    import json
    from pathlib import Path

    store = Path(job_env["SPECLAB_HOME"]) / "datastores" / "smoke-build-datastore"
    meta = json.loads((store / "datastore.json").read_text())
    assert len(meta["shards"]) == 2 and meta["num_tokens"] > 10_000
    target = next(Path(job_env["SPECLAB_HOME"]).glob("models/tiny-*/target"))
    out = {}
    for method, knobs in (("ar", []), ("rest", ["--datastore", str(store),
                                                "--candidates", "4"])):
        res = run_cmd([python(), "-m", "speclab.cli", "generate", "--target", str(target),
                       "--method", method, *knobs, "--prompt", "import os\nimport sys\n",
                       "--max-new-tokens", "16", "--json"], job_env)
        assert res.returncode == 0, res.stderr[-2000:]
        out[method] = json.loads(res.stdout.strip().splitlines()[-1])["token_ids"]
    assert out["rest"] == out["ar"]


def check_specdecpp_runs(tracking_uri: str, stdout: str) -> None:
    """One head trained as a child run; the comparison, oracle and Pareto plot on the
    parent; every method reproduces AR (greedy)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name("speclab-smoke")
    runs = client.search_runs([exp.experiment_id])
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id
                and r.data.tags.get("kind") != "method"]
    assert len(children) == 1 and "heldout_ece" in children[0].data.metrics
    points = method_children(client, parent)  # AR, 2 fixed gammas, 1 head x 2 thresholds
    assert sorted(points) == ["D1-w3@h=0.3", "D1-w3@h=0.7", "ar", "gamma=2", "gamma=4"]
    assert points["D1-w3@h=0.3"].data.params["method.name"] == "specdecpp"
    assert points["D1-w3@h=0.3"].data.params["method.stop_threshold"] == "0.3"
    assert points["gamma=4"].data.metrics["eq23_tokens_per_s"] > 0
    assert math.isnan(points["ar"].data.metrics["eq23_tokens_per_s"])
    m = parent.data.metrics
    assert m["fixed_points"] == 2 and 0 < m["oracle_verification_rate"] <= 1
    assert m["t_draft_s"] > 0 and m["t_target_s"] > 0
    arts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"specdecpp_comparison.csv", "pareto_discard_vs_verification.png"} <= arts, arts
    lines = [ln for ln in stdout.splitlines() if ln.startswith(("gamma=", "D1-w3@h="))]
    assert len(lines) >= 4 and all(ln.rstrip().endswith("True") for ln in lines[-4:])


def check_recommend_eval_runs(tracking_uri: str, stdout: str) -> None:
    """Target + one drafter per loss as child runs; the Table 1 shape on the parent."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name("speclab-smoke")
    runs = client.search_runs([exp.experiment_id])
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id
                and r.data.tags.get("kind") != "method"]
    assert sorted(r.data.tags.get("loss", "target") for r in children) == [
        "atspeed_s", "sft", "target"]
    points = method_children(client, parent)  # verify x drafter x K x N
    rows = [ln.split() for ln in stdout.splitlines() if ln.startswith(("strict ", "relaxed "))]
    assert len(points) == len(rows) > 0
    p = points["strict/sft/K3/N5"]
    assert (p.data.params["method.verify"], p.data.params["method.K"]) == ("strict", "3")
    assert {"ws_at_k", "ws_at_k_std", "as_at_k", "as_at_k_std", "recall_at_k"} <= set(
        p.data.metrics)
    assert parent.data.metrics["best_as_at_k"] == max(
        c.data.metrics["as_at_k"] for c in points.values())
    arts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"rec_results.csv", "as_vs_k.png", "ws_as_vs_n.png"} <= arts, arts
    for verify in ("strict", "relaxed"):
        for method in ("sft", "atspeed_s@0.5"):
            assert any(line.split()[:2] == [verify, method] for line in stdout.splitlines())


def check_comparison_runs(tracking_uri: str) -> None:
    """One parent run with the table and plot, one child run per loss."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name("speclab-smoke")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1
    parent = parents[0]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(r.data.tags["loss"] for r in children) == ["sft", "talf"]
    assert all(r.data.metrics["final_step"] == 10 for r in children)
    methods = [method_children(client, r) for r in children]  # each loss: its methods
    assert sorted(methods[0]) == sorted(methods[1]) and "ar" in methods[0]
    assert len({tuple(sorted(c.data.metrics)) for m in methods for c in m.values()}) == 1
    arts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"loss_comparison.csv", "loss_comparison.txt", "tau_by_loss.png"} <= arts, arts


def test_bad_config_fails_fast_naming_the_field(job_env):
    t0 = time.perf_counter()
    res = run_cmd([python(), "-m", "jobs.evaluate", "--config", SMOKE, "methods.0.gamma=0",
                   "resources.num_cpus_per_actor=-1"], job_env)
    assert res.returncode == 2
    assert "methods.0.gamma: Input should be greater than 0" in res.stderr
    assert "resources.num_cpus_per_actor" in res.stderr
    assert "Ray" not in res.stdout  # nothing started
    assert time.perf_counter() - t0 < 60


def test_unreachable_tracking_server_is_reported_before_work(job_env):
    job_env["MLFLOW_TRACKING_URI"] = f"http://127.0.0.1:{free_port()}"
    res = run_cmd([python(), "-m", "jobs.evaluate", "--config", SMOKE], job_env)
    assert res.returncode == 2
    assert job_env["MLFLOW_TRACKING_URI"] in res.stderr and "unreachable" in res.stderr
    assert "running on" not in res.stdout


def test_speclab_cli_rejects_bad_submit_config(job_env):
    res = run_cmd([python(), "-m", "speclab.cli", "submit", "evaluate", "--config", SMOKE,
                   "--address", f"http://127.0.0.1:{free_port()}", "decoding.top_p=2"], job_env)
    assert res.returncode == 2 and "decoding.top_p" in res.stderr


def test_evaluate_job_decodes_in_batches(job_env):
    """`decoding.batch_size`: the job's prompts go through the batched engine (AR at the
    same batch size); outputs still equal each prompt decoded alone."""
    res = run_cmd([python(), "-m", "jobs.evaluate", "--config", SMOKE, "decoding.batch_size=2",
                   "resources.num_actors=1", "name=smoke-evaluate-batched"], job_env)
    assert res.returncode == 0, res.stderr[-3000:]
    table = [ln for ln in res.stdout.splitlines()
             if ln.startswith(("ar ", "chain(", "tree ", "salf "))]  # short labels
    assert len(table) == 5 and all(ln.rstrip().endswith("True") for ln in table), res.stdout
    client, run = find_run(job_env["MLFLOW_TRACKING_URI"], "speclab-smoke")
    children = method_children(client, run)
    assert run.data.params["decoding.batch_size"] == "2"
    # two rows per forward: fewer target forwards than per-row rounds
    m = children["chain(gamma=2)"].data.metrics
    assert m["target_forwards_per_token"] < m["target_calls_per_token"]
    assert children["ar"].data.metrics["target_forwards_per_token"] == pytest.approx(0.5, abs=0.07)
    assert math.isnan(m["speedup_std"])  # one wall time for the whole batch: no spread


def test_evaluate_job_tests_orderings_between_labelled_methods(job_env, tmp_path):
    """`orderings`: each pair of method labels as a median paired tau ratio over the
    prompts with its interval and verdict, printed and logged on the parent run."""
    res = run_cmd([python(), "-m", "jobs.evaluate", "--config", SMOKE,
                   "resources.num_actors=1", "name=smoke-evaluate-orderings",
                   "methods=[{name: chain, gamma: 2, label: c2}, "
                   "{name: chain, gamma: 4, label: chain 4}]",
                   "orderings=[{above: chain 4, below: c2}, {above: c2, below: ar, "
                   "claim: a drafted token commits more than one}]"], job_env)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    tail = out[out.index("[evaluate] orderings, paired over prompts"):].splitlines()
    [line] = [ln for ln in tail if ln.startswith("chain 4 ")]
    assert line.split()[2] == "c2" and re.search(r"[+-]\d+\.\d% \[", line), line
    client, run = find_run(job_env["MLFLOW_TRACKING_URI"], "speclab-smoke")
    rows = json.loads(Path(client.download_artifacts(
        run.info.run_id, "orderings.json", str(tmp_path))).read_text())
    assert [(r["above"], r["below"], r["prompts"]) for r in rows] == [
        ("chain 4", "c2", 4), ("c2", "ar", 4)], rows
    children = method_children(client, run)
    assert rows[0]["tau_above"] == pytest.approx(children["chain 4"].data.metrics["tau"])
    assert rows[1]["tau_below"] == pytest.approx(1.0)
    assert rows[1]["verdict"] in ("holds", "unresolved")  # tau >= 1 on every prompt
    assert run.data.metrics["ordering_chain 4_over_c2"] == pytest.approx(rows[0]["difference"])
    bad = run_cmd([python(), "-m", "jobs.evaluate", "--config", SMOKE,
                   "orderings=[{above: chain(gamma=2), below: ar}]"], job_env)
    assert bad.returncode == 2 and "orderings[0].above: 'chain(gamma=2)' is no method's " \
        "label" in bad.stderr, bad.stderr[-2000:]


def test_evaluate_job_sweeps_batch_sizes_with_an_auto_budget(job_env):
    """`decoding.batch_sizes`: every method at each size (AR at the same size), then per
    size plain decoding, the best fixed method and the `budget: auto` one; the table
    and JSON logged, a child run per method with the batch size as step."""
    res = run_cmd([python(), "-m", "jobs.evaluate", "--config", SMOKE,
                   "decoding.batch_sizes=[1,2]", "resources.num_actors=1",
                   "methods=[{name: chain, gamma: 2}, {name: chain, gamma: 3, budget: auto}]",
                   "name=smoke-evaluate-sweep"], job_env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "[evaluate] batch size 1" in res.stdout and "[evaluate] batch size 2" in res.stdout
    sweep = res.stdout[res.stdout.index("[evaluate] batch sweep [1, 2]"):]
    assert "chain(budget=auto,gamma=3)" in sweep and "chain(gamma=2)" in sweep, sweep
    client, run = find_run(job_env["MLFLOW_TRACKING_URI"], "speclab-smoke")
    m = run.data.metrics
    assert {"batch_1/best_speedup", "batch_2/best_speedup"} <= set(m), sorted(m)
    assert run.data.tags["mlflow.note.content"].startswith("**Batch sweep [1, 2]**")
    local = Path(client.download_artifacts(run.info.run_id, "batch_sweep.json"))
    data = json.loads(local.read_text())
    assert [(r["batch_size"], r["auto"], r["best_fixed"]) for r in data["auto_sweep"]] == [
        (1, "chain(budget=auto,gamma=3)", "chain(gamma=2)"),
        (2, "chain(budget=auto,gamma=3)", "chain(gamma=2)")]
    assert all(r["auto_speedup"] > 0 and r["auto_budget_mean"] is not None
               for r in data["auto_sweep"])
    auto = [r for r in data["rows"] if r["method"] == "chain(budget=auto,gamma=3)"]
    assert [r["batch_size"] for r in auto] == [1, 2] and all(r["identical_to_ar"] for r in auto)
    assert {"batch_scaling.png", "batch_sweep.txt"} <= {
        a.path for a in client.list_artifacts(run.info.run_id)}
    children = method_children(client, run)
    assert sorted(children) == ["ar", "chain(budget=auto,gamma=3)", "chain(gamma=2)"]
    history = client.get_metric_history(children["chain(gamma=2)"].info.run_id, "speedup")
    assert sorted(h.step for h in history) == [1, 2]
    assert children["chain(budget=auto,gamma=3)"].data.params["method.budget"] == "auto"

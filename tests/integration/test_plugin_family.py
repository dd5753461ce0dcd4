"""A whole trained drafter family from a plugin (:mod:`tests.plugins.mlp_speculator`,
named in ``$SPECLAB_PLUGINS``; ``$SPECLAB_METHODS`` too, for the CLI's ``--method``
choices), with no edit to the package, through every surface:

(a) ``python -m jobs.train_drafter`` (``family: mlp_speculator``): ``feat`` data on Ray
    actors, the plugin's task on Ray Train, the artifact saved, registered in MLflow and
    evaluated against plain decoding (lossless);
(b) ``speclab generate --method mlp_speculator --mlp-model models:/...``: the same text
    as plain decoding;
(c) the Serve app with that artifact: HTTP on 127.0.0.1 answers plain decoding's
    completion;
(d) ``jobs.tune`` with ``sweep.kind: mlp_speculator`` over ``drafter.depth`` (2 trials,
    :func:`speclab.pipelines.tune_trials.family_trial`): ``best_config.yaml`` evaluates
    the best trial's own artifact.

One artifact (a module fixture) serves (a)-(c); the file takes about 4 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import requests
import yaml

from serve_apps.loadtest import PROMPTS
from tests.integration.conftest import (
    ROOT,
    find_run,
    method_children,
    python,
    refused_before_work,
    run_cmd,
)
from tests.integration.test_serve import _start, _stop

pytestmark = pytest.mark.integration
PLUGIN = "tests.plugins.mlp_speculator"
NEW = 16  # tokens decoded per request


def _plugin_env() -> dict[str, str]:
    """What makes every process (job drivers, Ray workers, Serve replicas) import the
    plugin: it registers the family, its objectives, task and method when imported."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {"SPECLAB_PLUGINS": PLUGIN, "SPECLAB_METHODS": PLUGIN, "PYTHONPATH": path}


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    """A job environment of the module (one SPECLAB_HOME and SQLite MLflow store) with the
    plugin, and the tiny target every part decodes."""
    from speclab.models.registry import ensure_tiny_pair

    root = tmp_path_factory.mktemp("plugin_family")
    target, _ = ensure_tiny_pair(root / "models")
    e = dict(os.environ)
    e.pop("RAY_ADDRESS", None)
    e.update({"SPECLAB_HOME": str(root / "home"),
              "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}",
              "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
              "PYTHONUNBUFFERED": "1", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1",
              "PATH": f"{Path(sys.executable).parent}{os.pathsep}{e.get('PATH', '')}",
              **_plugin_env()})
    return {"root": root, "target": target, "env": e}


def _common(target: str) -> dict:
    """The tiny budget both jobs share: 32 feat windows, a 1-worker Ray Train run."""
    return {"models": {"target": target},
            "corpus": {"max_chars": 200000, "val_chars": 20000},
            "distill": {"top_k": 4, "examples": 32, "shard_size": 16, "seq_len": 24,
                        "gen_actors": 1},
            "scaling": {"num_workers": 1, "cpus_per_worker": 0.5},
            "data": {"num_prompts": 2, "context_chars": 120},
            "decoding": {"max_new_tokens": 12, "timing_passes": 1}}


@pytest.fixture(scope="module")
def plain(env) -> dict[str, tuple[list[int], str]]:
    """Plain decoding's greedy tokens and text for the prompts the parts decode."""
    from speclab.api import Decoder

    dec = Decoder.from_pretrained(env["target"])
    out = {}
    for p in PROMPTS[:2]:
        res = dec.generate(p, method="ar", max_new_tokens=NEW)
        out[p] = (res.token_ids, dec.tokenizer.decode(res.token_ids, skip_special_tokens=True))
    return out


def _train_config(env: dict) -> dict:
    """(a)'s config: family mlp_speculator (3 stages, the target's top-k), 20 steps."""
    root = env["root"]
    return {"name": "plugin-mlp", "job": "train_drafter", "family": "mlp_speculator",
            **_common(env["target"]),
            "drafter": {"depth": 3, "loss": "mlp_kd"},
            "train": {"steps": 20, "batch_size": 8, "lr": 0.003, "warmup": 2,
                      "report_every": 10},
            "output": {"storage_path": str(root / "runs"), "run_name": "mlp",
                       "register_as": "plugin-mlp"},
            "methods": [{"name": "mlp_speculator"},
                        {"name": "mlp_speculator", "depth": 1, "label": "mlp-depth1"}],
            "tracking": {"experiment": "plugin"}}


@pytest.fixture(scope="module")
def trained(env) -> dict:
    """(a) ``jobs.train_drafter`` with family mlp_speculator, run once for the module."""
    root = env["root"]
    path = root / "train_drafter.yaml"
    path.write_text(yaml.safe_dump(_train_config(env)))
    res = run_cmd([python(), "-m", "jobs.train_drafter", "--config", str(path)], env["env"],
                  timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return {"stdout": res.stdout, "folder": root / "runs" / "mlp" / "mlp_speculator",
            "uri": "models:/plugin-mlp/1"}


def test_train_drafter_trains_registers_and_evaluates_the_plugin_family(env, trained):
    assert f"registered as {trained['uri']}" in trained["stdout"]
    meta = json.loads((trained["folder"] / "config.json").read_text())
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(env["target"])
    assert meta["kind"] == "speclab-mlp-speculator" and meta["depth"] == 3
    assert (meta["vocab_size"], meta["hidden_size"]) == (config.vocab_size, config.hidden_size)
    assert (trained["folder"] / "model.safetensors").stat().st_size > 0
    client, run = find_run(env["env"]["MLFLOW_TRACKING_URI"], "plugin")
    m, tags = run.data.metrics, run.data.tags
    assert (tags["job"], tags["family"], tags["loss"]) == ("train_drafter", "mlp_speculator",
                                                          "mlp_kd")
    assert m["shards.feat"] == 2 and m["final_step"] == 20
    assert m["final_val_loss"] == m["val_loss"] < 1e4
    for k in (1, 2, 3):  # the plugin task's own held-out figures, logged by rank 0
        assert 0 <= m[f"final_val_top1_s{k}"] <= 1
    assert [h.step for h in client.get_metric_history(run.info.run_id, "val_loss")] == [10, 20]
    assert client.get_model_version("plugin-mlp", "1").run_id == run.info.run_id
    evals = method_children(client, run)
    ours = {label: c for label, c in evals.items()
            if c.data.params["method.name"] == "mlp_speculator"}
    # an unlabelled method keeps its configured name as label (not the run folder)
    assert sorted(ours) == ["mlp-depth1", "mlp_speculator(depth=0,mlp_model=trained)"], \
        sorted(evals)
    for c in evals.values():  # lossless at T=0: every method's outputs are AR's
        assert c.data.metrics["identical_to_ar"] == 1.0, c.data.tags
    for c in ours.values():  # it really drafted (a chain per round), from the artifact
        assert c.data.metrics["tau"] >= 1.0 and c.data.metrics["acceptance_rate"] >= 0


@pytest.mark.parametrize("overrides,message", [
    (["drafter.depth=0"], "drafter.depth: Input should be greater than or equal to 1"),
    (["drafter.loss=medusa1"], "drafter.loss: unknown objective: unknown mlp_speculator "
                               "objective 'medusa1'; known: mlp_ce, mlp_kd"),
    (["distill.seq_len=12", "drafter.depth=12"],
     "drafter.depth (12) must be below distill.seq_len (12)"),
    (["family=nope"], "family: unknown drafter family 'nope'; known: atspeed, eagle"),
    (["output.export=[medusa]"], "output.export: family 'mlp_speculator' exports to "
                                 "speclab, not medusa"),
])
def test_bad_input_is_refused_before_work(env, tmp_path, overrides, message):
    """Refused before Ray starts, naming the field (in this process: the plugin
    imported here, as $SPECLAB_PLUGINS imports it in a job's)."""
    import tests.plugins.mlp_speculator  # noqa: F401

    path = tmp_path / "train_drafter.yaml"
    path.write_text(yaml.safe_dump(_train_config(env)))
    refused_before_work("train_drafter", str(path), overrides, message, env["env"],
                        tmp_path / "runs")


def test_cli_generate_decodes_with_the_registered_artifact(env, trained, plain):
    prompt = PROMPTS[0]
    cli = run_cmd([python(), "-m", "speclab.cli", "generate", "--target", env["target"],
                   "--method", "mlp_speculator", "--mlp-model", trained["uri"],
                   "--prompt", prompt, "--max-new-tokens", str(NEW), "--json"], env["env"],
                  timeout=300)
    assert cli.returncode == 0, cli.stderr[-2000:]
    got = json.loads(cli.stdout.strip().splitlines()[-1])
    assert got["token_ids"] == plain[prompt][0]
    assert got["stats"]["drafted_tokens"] > 0  # the speculator drafted every round
    text = run_cmd([python(), "-m", "speclab.cli", "generate", "--target", env["target"],
                    "--method", "mlp_speculator", "--mlp-model", str(trained["folder"]),
                    "--depth", "2", "--prompt", prompt, "--max-new-tokens", str(NEW)],
                   env["env"], timeout=300)
    assert text.returncode == 0, text.stderr[-2000:]
    from speclab.api import Decoder

    want = Decoder.from_pretrained(env["target"]).generate(prompt, method="ar",
                                                          max_new_tokens=NEW).text
    assert text.stdout.rstrip("\n") == want


def test_serve_app_serves_the_plugin_family(env, trained, plain):
    root = env["root"] / "serve"
    root.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        for key, value in _plugin_env().items():
            mp.setenv(key, value)
        method = json.dumps({"name": "mlp_speculator", "mlp_model": str(trained["folder"])})
        proc, url = _start(root, [f"models.target={env['target']}", f"method={method}",
                                  "serve.target.num_cpus=0.4", "serve.draft.num_cpus=0.4"])
    try:
        for p in PROMPTS[:2]:
            r = requests.post(f"{url}/v1/completions", json={
                "prompt": p, "max_tokens": NEW, "temperature": 0}, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == plain[p][1]
        r = requests.post(f"{url}/generate", json={"prompt": PROMPTS[0], "max_tokens": NEW},
                          timeout=120)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["method"] == "mlp_speculator" and body["token_ids"] == plain[PROMPTS[0]][0]
        assert body["stats"]["drafted_tokens"] > 0  # drafted on the draft replica
    finally:
        _stop(proc)


def test_tune_sweeps_the_plugin_family_and_writes_a_best_config(env):
    root = env["root"]
    config = {"name": "plugin-mlp-tune", "job": "tune", **_common(env["target"]),
              "drafter": {"depth": 2, "loss": "mlp_kd"},
              "train": {"steps": 6, "batch_size": 8, "lr": 0.003, "warmup": 1,
                        "report_every": 6},
              "method": {"name": "mlp_speculator"},  # mlp_model: each trial's artifact
              "sweep": {"kind": "mlp_speculator", "space": {"drafter.depth": {"grid": [1, 2]}},
                        "search": "grid", "metric": "tau", "max_concurrent": 2,
                        "trial_cpus": 0.5},
              "output": {"storage_path": str(root / "sweeps"), "run_name": "sw"},
              "tracking": {"experiment": "plugin-tune"}}
    path = root / "tune.yaml"
    path.write_text(yaml.safe_dump(config))
    res = run_cmd([python(), "-m", "jobs.tune", "--config", str(path)], env["env"],
                  timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    sweep = root / "sweeps" / "sw"
    depths = sorted(json.loads(p.read_text())["depth"]
                    for p in sweep.glob("trials/mlp_speculator-*/mlp_speculator/config.json"))
    assert depths == [1, 2]  # each trial trained its own drafter.depth
    client, parent = find_run(env["env"]["MLFLOW_TRACKING_URI"], "plugin-tune")
    assert parent.data.metrics["shards.feat"] == 2 and parent.data.metrics["trials"] == 2
    children = client.search_runs([parent.info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert len(children) == 2
    for c in children:
        m = c.data.metrics
        assert c.data.tags["status"] == "ok" and m["step"] == 6, c.data.tags
        assert m["identical_to_ar"] == 1.0 and m["val_loss"] < 1e4 and m["tau"] >= 1.0
    best = yaml.safe_load((sweep / "best_config.yaml").read_text())
    assert best["job"] == "evaluate" and best["method"]["name"] == "mlp_speculator"
    artifact = Path(best["method"]["mlp_model"])
    assert artifact.parent.parent == sweep / "trials" and artifact.name == "mlp_speculator"
    assert json.loads((artifact / "config.json").read_text())["kind"] == \
        "speclab-mlp-speculator"
    import tests.plugins.mlp_speculator  # noqa: F401  (the method, for validation here)
    from speclab.config import load_experiment

    cfg = load_experiment(sweep / "best_config.yaml")  # ready to run as it is
    assert cfg.job == "evaluate" and cfg.method.mlp_model == str(artifact)

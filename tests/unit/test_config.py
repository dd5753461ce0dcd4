"""Strict configs: unknown keys rejected, errors name the dotted field, overrides apply;
one config model per job (a group the job does not use is an error naming it), and
renamed keys point at their new names."""

import subprocess
import sys
from pathlib import Path

import pytest

from speclab.config import (
    JOB_CONFIGS,
    ConfigError,
    DistillJob,
    EvaluateJob,
    ExperimentConfig,
    TuneJob,
    load_experiment,
)

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_and_override_precedence(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("method: {name: chain, gamma: 3}\ndecoding: {max_new_tokens: 10}\n")
    cfg = ExperimentConfig.from_yaml(path, ["method.gamma=7", "data.num_prompts=2"])
    assert isinstance(cfg, EvaluateJob)  # no `job:` key: an evaluate config
    assert cfg.method.gamma == 7  # flag > yaml
    assert cfg.decoding.max_new_tokens == 10  # yaml > default
    assert cfg.data.num_prompts == 2
    assert cfg.method_list() == [cfg.method]
    assert cfg.method.params() == {"gamma": 7}


def test_reference_large_loads_in_its_run_dtype_unless_a_dtype_is_given(monkeypatch):
    """Every job loads ``reference-large`` as ``speclab bench`` does (bfloat16 where it is
    native, float32 elsewhere: ``reference_large.run_dtype``); an explicit dtype wins, and
    every other target stays float32 by default."""
    import speclab.reference_large as large

    for native, expected in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(large, "native_bfloat16", lambda device="cpu", n=native: n)
        cfg = EvaluateJob.from_dict({}, ["models.target=reference-large"])
        assert cfg.models.dtype == expected
    cfg = EvaluateJob.from_dict({}, ["models.target=reference-large", "models.dtype=float32"])
    assert cfg.models.dtype == "float32"
    monkeypatch.setattr(large, "native_bfloat16", lambda device="cpu": True)
    assert EvaluateJob.from_dict({}, []).models.dtype == "float32"
    serve = JOB_CONFIGS["serve"].from_dict({"job": "serve"}, ["models.target=reference-large"])
    assert serve.models.dtype == "bfloat16"


@pytest.mark.parametrize(
    "data,overrides,message",
    [
        ({"method": {"gamma": 0}}, [], "method.gamma: Input should be greater than 0"),
        ({"bogus": 1}, [], "bogus: Extra inputs are not permitted"),
        ({"method": {"name": "salf", "salf_threshold": 1.0}}, [], "method.salf_threshold"),
        ({}, ["methods=[{name: chain}]", "methods.0.gamma=-1"], "methods.0.gamma"),
        ({}, ["decoding.top_p=0"], "decoding.top_p"),
        ({}, ["models.device=tpu"], "models.device"),
        ({}, ["method.name=salf", "method.batch=40", "method.nodes=8"], "batch (40)"),
        ({}, ["noequals"], "expected key=value"),
        ({}, ["data.prompts=jsonl"], "path is required"),
        ({}, ["decoding.temperature=0.7", "decoding.verify=typical",
              "decoding.verify_params={epsilon: 0}"], "verify_params (typical): epsilon"),
        ({}, ["decoding.verify_params={epsilon: 0.2}"], "verify_params (greedy): epsilon"),
        ({}, ["decoding.verify=nope"], "decoding.verify: must be one of"),
        ({}, ["decoding.verify=greedy", "decoding.temperature=0.5"],
         "verify: 'greedy' needs temperature 0"),
        ({}, ["method={name: medusa}"], "method 'medusa' needs heads"),
        ({}, ["method={name: medusa, medusa_model: x, tree: dense}"], "method.tree"),
        ({}, ["method.budget=some"], "method.budget"),
        ({}, ["decoding.batch_sizes=[0, 4]"], "decoding.batch_sizes"),
        ({}, ["decoding.batch_sizes=[4, 32]"],
         r"decoding.batch_sizes: the largest (32) exceeds data.num_prompts (16)"),
        ({"job": "distill"}, ["decoding.batch_sizes=[1, 4]"],
         "decoding.batch_sizes: only the evaluate job"),
        ({"job": "serve"}, ["method.budget=auto"], "set serve.budget: auto instead"),
    ],
)
def test_errors_name_the_field(data, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ExperimentConfig.from_dict(data, overrides)


def test_a_method_takes_a_budget_beside_its_knobs():
    """``budget`` is every method's (not a knob of its drafter): given, it travels with
    the knobs to ``Decoder.generate``; not given, the knobs (and labels) are as before."""
    cfg = ExperimentConfig.from_dict({}, [
        "methods=[{name: chain, gamma: 4, budget: auto}, {name: chain, gamma: 2}]",
        "decoding.batch_sizes=[4, 1, 4]"])
    auto, fixed = cfg.method_list()
    assert auto.params() == {"gamma": 4, "budget": "auto"}
    assert fixed.params() == {"gamma": 2} and fixed.budget is None
    assert cfg.decoding.batch_sizes == [1, 4]


def test_decoding_verify_takes_any_rule_of_the_registry(monkeypatch):
    """No list of rule names in the schema: a rule registered at run time validates, with
    its parameters checked by its own parameter model."""
    from pydantic import Field

    from speclab.config.base import StrictModel
    from speclab.decoding.rules import RULES, Rule

    class ToyParams(StrictModel):
        k: int = Field(1, ge=1)

    monkeypatch.setitem(RULES, "toy", Rule("toy", lambda *args: None, ToyParams))
    cfg = ExperimentConfig.from_dict({}, ["decoding.verify=toy", "decoding.verify_params={k: 3}"])
    assert cfg.decoding.verify == "toy" and cfg.decoding.verify_params == {"k": 3}
    with pytest.raises(ConfigError, match=r"verify_params \(toy\): k: Input should be greater"):
        ExperimentConfig.from_dict({}, ["decoding.verify=toy", "decoding.verify_params={k: 0}"])
    cfg = ExperimentConfig.from_dict({}, ["decoding.verify=conditional",
                                          "decoding.verify_params={alpha: 0.2}"])
    assert cfg.decoding.verify_params == {"alpha": 0.2}


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        ExperimentConfig.from_yaml(tmp_path / "none.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("method: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        ExperimentConfig.from_yaml(bad)


def test_the_job_key_selects_the_jobs_own_config_model():
    for job, model in JOB_CONFIGS.items():
        data = {"job": job, "sweep": {"space": {"method.gamma": {"grid": [2]}}}} \
            if job == "tune" else {"job": job}
        assert type(ExperimentConfig.from_dict(data)) is model
    assert isinstance(ExperimentConfig.from_dict({"job": "distill"}), DistillJob)
    assert "distill" not in EvaluateJob.model_fields and "head" not in EvaluateJob.model_fields
    with pytest.raises(ConfigError, match="job: unknown job 'nope'"):
        ExperimentConfig.from_dict({"job": "nope"})
    with pytest.raises(ConfigError, match="job: this is a 'distill' config"):
        EvaluateJob.from_dict({"job": "distill"})  # e.g. python -m jobs.evaluate on it


@pytest.mark.parametrize("data,group", [
    ({"job": "evaluate", "head": {"depth": 1}}, "head"),
    ({"job": "train_target", "methods": [{"name": "chain"}]}, "methods"),
    ({"job": "distill", "rec_eval": {}}, "rec_eval"),
    ({"job": "serve", "data": {"num_prompts": 2}}, "data"),
    ({"job": "tune", "sweep": {"space": {"method.gamma": {"grid": [2]}}}, "rec": {}}, "rec"),
    ({"job": "tune", "sweep": {"kind": "atspeed", "space": {"rec_eval.align_alpha":
                                                            {"grid": [0.5]}}},
      "method": {"name": "chain"}}, "method"),
])
def test_a_group_the_job_does_not_use_is_an_error_naming_it(data, group):
    with pytest.raises(ConfigError, match=rf"^{group}: the {data['job']} job does not use"):
        ExperimentConfig.from_dict(data)


@pytest.mark.parametrize("data,message", [
    ({"decoding": {"top_k_sampling": 5}},
     "decoding.top_k_sampling: renamed: use sample_top_k instead"),
    ({"job": "recommend_eval", "rec_eval": {"alphas": [0.5]}},
     "rec_eval.alphas: renamed: use align_alphas instead"),
    ({"job": "recommend_eval", "rec_eval": {"draft_loss": "sft"}},
     "rec_eval.draft_loss: renamed: use losses instead"),
    ({"job": "tune", "sweep": {"kind": "atspeed", "space": {"rec_eval.ns": {"grid": [[5]]}}},
      "rec_eval": {"alpha": 0.5}}, "rec_eval.alpha: renamed: use align_alpha instead"),
])
def test_old_keys_are_rejected_naming_the_new_key(data, message):
    with pytest.raises(ConfigError, match=message):
        ExperimentConfig.from_dict(data)


def test_new_names_load():
    cfg = ExperimentConfig.from_dict({"decoding": {"sample_top_k": 5}})
    assert cfg.decoding.model_dump()["sample_top_k"] == 5
    rec = ExperimentConfig.from_dict({"job": "recommend_eval", "rec_eval": {
        "losses": ["sft", "atspeed_r"], "align_alphas": [0.3, 0.7]}})
    assert rec.rec_eval.align_alphas == [0.3, 0.7] and "draft_loss" not in rec.rec_eval.model_fields
    tune = TuneJob.from_dict({"sweep": {"kind": "atspeed", "space": {
        "rec_eval.align_alpha": {"grid": [0.2, 0.8]}}}, "rec_eval": {"draft_loss": "atspeed_s"}})
    assert tune.rec_eval.align_alpha == 0.5 and tune.rec_eval.draft_loss == "atspeed_s"


def test_load_experiment_is_the_public_loader(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("job: build_datastore\ndatastore: {shards: 3}\n")
    assert load_experiment(path, ["datastore.max_len=8"]).datastore.max_len == 8


@pytest.mark.parametrize("command", [
    [sys.executable, "-m", "jobs.evaluate"],
    [sys.executable, "-m", "speclab.cli", "run", "evaluate"],
], ids=["python -m jobs.evaluate", "speclab run evaluate"])
def test_an_evaluate_config_with_a_head_group_exits_2_naming_head(tmp_path, command):
    cfg = tmp_path / "x.yaml"
    cfg.write_text("name: x\njob: evaluate\nmodels: {target: tiny}\nhead: {depth: 1}\n"
                   "tracking: {enabled: false}\n")
    # speclab run from outside the checkout (the installed package, no `jobs` package)
    cwd = ROOT if command[2] == "jobs.evaluate" else tmp_path
    res = subprocess.run([*command, "--config", str(cfg)], cwd=cwd, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "head: the evaluate job does not use a 'head' group" in res.stderr
    assert "running on" not in res.stdout  # no work started


def test_serve_refuses_a_non_loopback_host_without_an_api_key():
    """``speclab serve --api-key K`` adds ``serve.api_key`` as a JSON-quoted override, so
    any key (colons, braces) survives YAML and the host check sees it."""
    import json
    from pathlib import Path

    from speclab.config import ServeJob

    cfg = Path(__file__).resolve().parents[2] / "experiments" / "smoke" / "serve.yaml"
    with pytest.raises(ValueError, match="api_key: required when serving on '0.0.0.0'"):
        ServeJob.from_yaml(cfg, ["serve.host=0.0.0.0"])
    key = "k: {1} #x"
    job = ServeJob.from_yaml(cfg, ["serve.host=0.0.0.0", f"serve.api_key={json.dumps(key)}"])
    assert job.serve.api_key == key


def test_switching_the_method_by_override_drops_the_old_methods_knobs():
    """``speclab serve --config experiments/smoke/serve.yaml method.name=chain`` once failed
    with ``method.nodes: Extra inputs are not permitted`` (SALF's knobs stayed)."""
    from speclab.config import ServeJob

    cfg = ServeJob.from_yaml("experiments/smoke/serve.yaml", ["method.gamma=3",
                                                               "method.name=chain"])
    assert cfg.method.name == "chain" and cfg.method.gamma == 3
    same = ServeJob.from_yaml("experiments/smoke/serve.yaml", ["method.nodes=6"])
    assert same.method.name == "salf" and same.method.nodes == 6  # same method: kept


@pytest.mark.parametrize("config,overrides,expected", [
    ("distill.yaml", ["output.run_name=draft-s150"], "draft-s150"),
    ("distill.yaml", ["output.run_name=draft-s150", "tracking.run_name=mine"], "mine"),
    ("distill.yaml", [], None),  # the config's name
    ("evaluate.yaml", [], None),  # no output group
])
def test_the_parent_run_is_named_by_tracking_then_output_then_the_config(config, overrides,
                                                                         expected):
    from speclab.pipelines.cli import parent_run_name

    cfg = load_experiment(ROOT / "experiments" / "smoke" / config, overrides)
    assert parent_run_name(cfg) == (expected or cfg.name)
    assert cfg.name and not cfg.name.startswith("draft-s150")

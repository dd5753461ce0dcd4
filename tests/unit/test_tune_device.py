"""Tune trials on the config's device and dtype, without Ray or a GPU: what a trial
reserves (``sweep.trial_gpus`` against ``models.device`` and the cluster's GPUs), where
and in what dtype its models load (decoding, timings, held-out head metrics, AtSpeed),
and contradictions refused before any work, naming both fields."""

from __future__ import annotations

import pytest
import torch

from speclab.config import ConfigError, ExperimentConfig, TuneJob
from speclab.sweep import (
    load_decoder,
    load_models,
    on_device,
    trial_base,
    trial_config,
    trial_device,
    trial_resources,
)

SPACE = {"method.gamma": {"grid": [2, 3]}}


def _cfg(models: dict | None = None, **sweep) -> TuneJob:
    return TuneJob.from_dict({"job": "tune", "models": {"target": "tiny", **(models or {})},
                              "method": {"name": "chain", "gamma": 2},
                              "sweep": {"space": SPACE, "trial_cpus": 0.5, **sweep}})


@pytest.mark.parametrize("device,gpus,cluster,want_gpus,want_device", [
    ("cpu", None, 0, 0.0, "cpu"),
    ("cpu", None, 4, 0.0, "cpu"),  # GPUs in the cluster, but the config says cpu
    ("cpu", 0, 4, 0.0, "cpu"),
    ("auto", None, 0, 0.0, "cpu"),
    ("auto", None, 2, 1.0, "cuda"),
    ("auto", 0, 2, 0.0, "cpu"),
    ("auto", 0.5, 2, 0.5, "cuda"),
    ("cuda", None, 1, 1.0, "cuda"),
    ("cuda:1", None, 2, 1.0, "cuda"),  # the trial's own GPU is its cuda:0
    ("cuda", 0.25, 1, 0.25, "cuda"),
])
def test_a_trial_reserves_gpus_exactly_when_its_device_needs_them(device, gpus, cluster,
                                                                  want_gpus, want_device):
    cfg = _cfg({"device": device}, **({} if gpus is None else {"trial_gpus": gpus}))
    res = trial_resources(cfg, cluster)
    assert res == {"cpu": 0.5, "gpu": want_gpus}
    assert trial_device(cfg, res["gpu"]) == want_device
    trial = trial_config(trial_base(cfg, want_device), {"method.gamma": 3})
    assert trial.models.device == want_device and trial.method.gamma == 3
    assert cfg.sweep_base()["models"]["device"] == device  # the best config keeps the user's


@pytest.mark.parametrize("models,sweep,message", [
    ({"device": "cpu"}, {"trial_gpus": 1}, "models.device: 'cpu' but sweep.trial_gpus is 1"),
    ({"device": "cpu"}, {"trial_gpus": 0.5}, "models.device: 'cpu' but sweep.trial_gpus is 0.5"),
    ({"device": "cuda"}, {"trial_gpus": 0}, "models.device: 'cuda' but sweep.trial_gpus is 0"),
    ({"device": "cuda:1"}, {"trial_gpus": 0},
     "models.device: 'cuda:1' but sweep.trial_gpus is 0"),
    ({}, {"trial_gpus": 2}, "sweep.trial_gpus"),
    ({}, {"trial_gpus": -1}, "sweep.trial_gpus"),
])
def test_a_device_that_contradicts_trial_gpus_is_refused_by_the_config(models, sweep, message):
    data = {"job": "tune", "models": models, "sweep": {"space": SPACE, **sweep}}
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        ExperimentConfig.from_dict(data)


def test_an_atspeed_sweep_reserves_no_gpu():
    data = {"job": "tune", "sweep": {"kind": "atspeed", "trial_gpus": 1,
                                     "space": {"rec_eval.align_alpha": {"grid": [0.2, 0.8]}}}}
    with pytest.raises(ConfigError, match="sweep.trial_gpus is 1 but an atspeed sweep"):
        ExperimentConfig.from_dict(data)
    del data["sweep"]["trial_gpus"]
    cfg = ExperimentConfig.from_dict(data)
    assert trial_resources(cfg, 8)["gpu"] == 0 and trial_device(cfg, 0) == "cpu"


@pytest.mark.parametrize("device,sweep,message", [
    ("cuda", {}, "models.device: 'cuda' but the Ray cluster has no GPU"),
    ("cuda:0", {"trial_gpus": 1}, "models.device: 'cuda:0' but the Ray cluster has no GPU"),
    ("auto", {"trial_gpus": 1}, "sweep.trial_gpus is 1 but the Ray cluster has no GPU"),
])
def test_a_cuda_trial_on_a_cluster_without_gpus_is_refused(device, sweep, message):
    cfg = _cfg({"device": device}, **sweep)
    with pytest.raises(ValueError, match=message) as err:
        trial_resources(cfg, 0)
    assert "models.device" in str(err.value) and "sweep.trial_gpus" in str(err.value)


SMOKE = "experiments/smoke/tune.yaml"


def _job(argv: list[str], monkeypatch, capsys, cluster: dict) -> tuple[int, str]:
    """``jobs.tune`` in this process: Ray replaced by a fake cluster with ``cluster``'s
    resources (``ray.init`` fails), prepare by a stub; returns (exit status, stderr)."""
    import ray

    import speclab.jobs.tune as job
    import speclab.raylib

    def no_work(*args, **kwargs):
        raise AssertionError("work started: the sweep was not refused before it")

    monkeypatch.setattr(ray, "init", no_work)
    monkeypatch.setattr(ray, "cluster_resources", lambda: dict(cluster))
    monkeypatch.setattr(speclab.raylib, "init_ray", lambda *a, **k: "a fake cluster")
    monkeypatch.setattr(job, "prepare", lambda cfg: job.Inputs("t", None, [[1]], None, None))
    monkeypatch.setattr(job, "sweep_forward_times", no_work)
    try:
        rc = job.main(["--config", SMOKE, *argv, "tracking.enabled=false"])
    except SystemExit as exc:
        rc = exc.code
    return rc, capsys.readouterr().err


def test_the_job_refuses_contradictions_before_any_work(monkeypatch, capsys):
    rc, err = _job(["models.device=cpu", "sweep.trial_gpus=1"], monkeypatch, capsys, {"GPU": 1})
    assert rc == 2 and "models.device: 'cpu' but sweep.trial_gpus is 1" in err, err
    rc, err = _job(["models.device=cuda"], monkeypatch, capsys, {"CPU": 2.0})
    assert rc == 2 and "models.device: 'cuda' but the Ray cluster has no GPU" in err, err
    assert "sweep.trial_gpus" in err


def test_a_sweep_over_the_device_is_refused():
    import speclab.jobs.tune as job

    cfg = _cfg({"device": "auto"})
    cfg.sweep.space = {"models.device": cfg.sweep.space["method.gamma"].model_copy(
        update={"grid": ["cpu", "cuda"]})}
    with pytest.raises(ValueError, match="'models.device' cannot be swept"):
        job.prepare(cfg)


@pytest.mark.parametrize("config,field,grid", [
    ("eagle3_smoke", "eagle.data", ["corpus", "target"]),
    ("eagle3_smoke", "eagle.talf_depth", [2, 3]),
    ("eagle3_smoke", "distill.seq_len", [16, 24]),
    ("head_smoke", "distill.examples", [16, 32])])
def test_a_training_sweep_over_its_data_is_refused(config, field, grid):
    """An eagle or train_head sweep generates its training data once from the base
    config, so a swept field the data depends on would train every trial on the same
    data: refused, naming it, before any work."""
    import speclab.jobs.tune as job
    from speclab.config.jobs import load_experiment

    cfg = load_experiment(f"experiments/sweeps/{config}.yaml",
                          [f"sweep.space={{{field}: {{grid: {grid}}}}}"])
    with pytest.raises(ValueError, match=f"'{field}' cannot be swept: a {cfg.sweep.kind} "
                                         "sweep generates"):
        job.prepare(cfg)


# ---------------------------------------------------------------- loading, dtype and device

@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_trials_models_load_in_the_configs_dtype_on_its_device(tiny_pair, dtype):
    cfg = trial_config(trial_base(_cfg({"dtype": dtype, "device": "auto"}), "cpu"), {})
    dec = load_decoder(cfg, tiny_pair["target"], tiny_pair["close"])
    want = getattr(torch, dtype)
    for runner in (dec.target, dec.draft):
        assert runner.dtype == want and runner.device.type == "cpu"
    assert load_decoder(cfg, tiny_pair["target"], tiny_pair["close"]) is dec  # cached
    f32 = trial_config(trial_base(_cfg(), "cpu"), {})
    assert load_decoder(f32, tiny_pair["target"], tiny_pair["close"]).target.dtype == torch.float32


def test_the_sweeps_forward_times_are_taken_in_the_trials_dtype(tiny_pair, monkeypatch):
    """t_draft / t_target (predicted_speedup's constants) come from models loaded as a
    trial loads them, here on the driver (no GPU in the trial's resources)."""
    import speclab.evaluation
    import speclab.jobs.tune as job

    seen = []
    real = speclab.evaluation.forward_times

    def spy(dec, prompt, n=16):
        seen.append((dec.target.dtype, dec.draft.dtype, dec.target.device.type))
        return real(dec, prompt, n=2)

    monkeypatch.setattr(speclab.evaluation, "forward_times", spy)
    cfg = _cfg({"dtype": "bfloat16", "device": "auto"})
    inputs = job.Inputs(tiny_pair["target"], tiny_pair["close"], [[1, 2, 3, 4]], None, None)
    t_draft, t_target = job.sweep_forward_times(cfg, inputs, {"cpu": 0.5, "gpu": 0.0}, "cpu")
    assert seen == [(torch.bfloat16, torch.bfloat16, "cpu")]
    assert t_draft > 0 and t_target > 0
    assert on_device(cfg, "cuda").models.device == "cuda" and cfg.models.device == "auto"
    assert load_models(on_device(cfg, "cpu"), tiny_pair["target"], None).draft is None


def test_held_out_head_metrics_use_the_trials_dtype(tiny_pair, tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    import speclab.models.loading as loading
    from speclab.config.schema import HeadConfig
    from speclab.decoding.acceptance_head import AcceptanceHead
    from speclab.families.specdecpp.stages import held_out_metrics

    rows = [{"prompt": [1, 2, 3], "x": [4, 5, 6], "y": [4, 7, 6], "p": [0.9, 0.1, 0.6]},
            {"prompt": [7, 8], "x": [9, 10], "y": [9, 10], "p": [0.8, 0.7]}]
    (tmp_path / "accept").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "accept" / "shard-00000.parquet")
    loaded = []
    real = loading.load_model

    def spy(*args, **kwargs):
        model = real(*args, **kwargs)
        loaded.append(next(model.parameters()).dtype)
        return model

    monkeypatch.setattr(loading, "load_model", spy)
    hidden = loading.load_model(tiny_pair["close"]).config.hidden_size
    loaded.clear()
    out = held_out_metrics(HeadConfig(), AcceptanceHead(hidden, 1).eval(), tiny_pair["close"],
                           tmp_path, "bfloat16", "cpu")
    assert loaded == [torch.bfloat16]
    assert 0.0 <= out["heldout_accuracy"] <= 1.0 and out["heldout_bce"] > 0


def test_atspeed_trial_models_load_in_the_configs_dtype(rec_pair):
    from speclab.families.atspeed.trial import rec_models

    cfg = TuneJob.from_dict({"job": "tune", "models": {"dtype": "bfloat16"}})
    rec, draft = rec_models(cfg, *rec_pair)
    assert rec.target.dtype == torch.bfloat16 and draft.dtype == torch.bfloat16
    assert draft.device.type == "cpu"


def test_trial_starts_record_the_device_and_the_gpus_ray_gave(tmp_path, monkeypatch):
    import json

    from speclab.sweep import log_start

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    log_start(str(tmp_path), {"method.gamma": 2}, trial_base(_cfg({"device": "cuda"}), "cuda"))
    log_start(str(tmp_path), {"method.gamma": 3})
    first, second = (json.loads(x) for x in (tmp_path / "trial_starts.jsonl").read_text()
                     .splitlines())
    assert first["device"] == "cuda" and first["cuda_visible_devices"] == "3"
    assert second["params"] == {"method.gamma": 3} and "device" not in second

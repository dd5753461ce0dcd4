"""Sweep helpers without Ray: search-space validation, per-trial configs, objective."""

import math

import pytest

from speclab.config import ConfigError, ExperimentConfig
from speclab.sweep import objective, trial_config

BASE = {"job": "tune", "models": {"target": "tiny"},
        "method": {"name": "salf", "nodes": 8, "batch": 2},
        "sweep": {"space": {"method.salf_threshold": {"grid": [0.1, 0.3]}}}}


def test_trial_config_applies_values_and_drops_the_sweep():
    cfg = trial_config(BASE, {"method.salf_threshold": 0.3, "method.nodes": 12})
    assert cfg.method.params()["salf_threshold"] == 0.3 and cfg.method.nodes == 12
    assert cfg.sweep is None


def test_a_bad_combination_fails_its_trial_with_the_field_named():
    with pytest.raises(ConfigError, match=r"batch \(20\) must not exceed nodes \(8\)"):
        trial_config(BASE, {"method.batch": 20})
    with pytest.raises(ConfigError, match="method.salf_threshold"):
        trial_config(BASE, {"method.salf_threshold": 1.5})


def test_objective_respects_floors_and_mode():
    m = {"speedup": 1.4, "accuracy": 0.2}
    def sw(mode: str, floor: dict) -> dict:
        return {"metric": "speedup", "mode": mode, "floor": floor}

    assert objective(m, sw("max", {})) == 1.4
    assert objective(m, sw("max", {"accuracy": 0.3})) == -math.inf
    assert objective(m, sw("min", {"accuracy": 0.3})) == math.inf
    assert objective(m, sw("max", {"accuracy": 0.1})) == 1.4


@pytest.mark.parametrize("sweep,message", [
    ({"space": {}}, "at least one swept parameter"),
    ({"space": {"method.gamma": {"uniform": [1, 4]}}}, "search grid"),
    ({"space": {"method.gamma": {"grid": [2], "choice": [3]}}}, "exactly one"),
    ({"space": {"gamma": {"grid": [2]}}}, "dotted path"),
    ({"space": {"method.gamma": {"randint": [5, 2]}}, "search": "random"}, "low must be < high"),
    ({"space": {"method.gamma": {"grid": [2]}}, "search": "optuna"}, "use choice"),
])
def test_bad_sweep_sections(sweep, message):
    with pytest.raises(ConfigError, match=message):
        ExperimentConfig.from_dict({"job": "tune", "sweep": sweep})


def test_a_method_name_sweep_keeps_each_trials_own_knobs():
    from speclab.config import TuneJob

    cfg = TuneJob.from_dict({"method": {"name": "tree", "tree_top_k": 3, "salf_threshold": 0.3,
                                        "nodes": 8, "batch": 2},
                             "sweep": {"space": {"method.name": {"grid": ["tree", "salf"]},
                                                 "method.nodes": {"grid": [6, 8]}}}})
    assert "salf_threshold" not in cfg.method.params()  # the base keeps its own knobs
    assert cfg.method.params()["tree_top_k"] == 3
    salf = trial_config(cfg.sweep_base(), {"method.name": "salf", "method.nodes": 6})
    assert salf.method.name == "salf" and salf.method.params()["salf_threshold"] == 0.3
    assert salf.method.nodes == 6 and "tree_top_k" not in salf.method.params()
    tree = trial_config(cfg.sweep_base(), {"method.name": "tree", "method.nodes": 6})
    assert tree.method.nodes == 6 and "salf_threshold" not in tree.method.params()


@pytest.mark.parametrize("space,method,message", [
    ({"method.name": {"grid": ["chain", "salf"]}, "method.gamma": {"grid": [2, 4]}}, None,
     "'method.gamma': gamma is not a knob of method 'salf'"),
    ({"method.name": {"choice": ["salf", "chain"]}, "method.batch": {"grid": [2]}}, None,
     "'method.batch': batch is not a knob of method 'chain'"),
    ({"method.gamma": {"grid": [2, 4]}}, {"name": "salf"},
     "'method.gamma': gamma is not a knob of method 'salf'"),
])
def test_a_swept_knob_that_a_swept_method_lacks_is_refused(space, method, message):
    """It would give identical trials (the knob is dropped from that method's config):
    refused before any work, naming the knob and the method, as `evaluate` and
    `speclab generate` refuse a knob the method does not have."""
    from speclab.config import TuneJob

    data = {"sweep": {"space": space}, **({"method": method} if method else {})}
    with pytest.raises(ConfigError, match=message):
        TuneJob.from_dict(data)


def test_the_smoke_sweep_varies_a_knob_of_every_swept_method():
    from speclab.config import TuneJob
    from speclab.paths import repo_root

    cfg = TuneJob.from_yaml(str(repo_root() / "experiments/smoke/tune.yaml"), [])
    names = cfg.sweep.space["method.name"].grid
    trials = {(n, v): trial_config(cfg.sweep_base(), {"method.name": n, "method.nodes": v})
              for n in names for v in cfg.sweep.space["method.nodes"].grid}
    assert len({t.method.model_dump_json() for t in trials.values()}) == len(trials) == 6


def test_an_unknown_swept_knob_is_not_a_field():
    from speclab.config import TuneJob

    with pytest.raises(ConfigError, match="'method.gama' is not a field"):
        TuneJob.from_dict({"sweep": {"space": {"method.gama": {"grid": [2]}}}})

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

    cfg = TuneJob.from_dict({"method": {"name": "chain", "gamma": 3, "salf_threshold": 0.3,
                                        "nodes": 8, "batch": 2},
                             "sweep": {"space": {"method.name": {"grid": ["chain", "salf"]},
                                                 "method.gamma": {"grid": [2, 4]}}}})
    assert cfg.method.params() == {"gamma": 3}  # the base keeps its own method's knobs
    salf = trial_config(cfg.sweep_base(), {"method.name": "salf", "method.gamma": 2})
    assert salf.method.name == "salf" and salf.method.params()["salf_threshold"] == 0.3
    chain = trial_config(cfg.sweep_base(), {"method.name": "chain", "method.gamma": 2})
    assert chain.method.params() == {"gamma": 2}
    with pytest.raises(ConfigError, match="'method.gama' is not a field"):
        TuneJob.from_dict({"sweep": {"space": {"method.gama": {"grid": [2]}}}})

"""Per-method child runs: identical metric keys, method.* params, readable labels."""

import math

import pytest

from speclab.pipelines.eval_plots import acceptance_table, method_figures, wrap_label
from speclab.pipelines.method_runs import (
    RUN_COLORS,
    log_best,
    log_child_runs,
    uniform_metrics,
)
from speclab.tracking import NullTracker


class Recorder(NullTracker):
    """A tracker that keeps what is logged (children too) instead of sending it."""

    def __init__(self, run_name: str = "job", config: dict | None = None) -> None:
        self.run_name, self.config = run_name, config or {}
        self.metrics: list[tuple[dict, int | None]] = []
        self.tags: dict = {}
        self.children: list[Recorder] = []

    def log_metrics(self, metrics, step=None):
        self.metrics.append((dict(metrics), step))

    def set_tags(self, tags):
        self.tags.update(tags)

    def log_series(self, key, values):
        self.series = (key, dict(values))

    def child(self, run_name, config):
        c = Recorder(run_name, config)
        self.children.append(c)
        return c

    def set_duration(self, seconds):
        self.duration = seconds


ROWS = [
    {"method": "ar", "tau": 1.0, "speedup": 1.0, "predicted_speedup": 1.0,
     "identical_to_ar": True, "decode_s": 2.5, **{f"accept_at_{k}": 0.0 for k in range(1, 7)}},
    {"method": "chain(gamma=2)", "tau": 1.5, "speedup": 1.2, "predicted_speedup": None,
     "identical_to_ar": False, "tau_std": 0.2, **{f"accept_at_{k}": 0.5 / k for k in range(1, 7)}},
]


def test_uniform_metrics_give_every_row_the_same_keys():
    out = uniform_metrics(ROWS)
    assert list(out[0]) == list(out[1])  # same keys, same order
    assert math.isnan(out[1]["predicted_speedup"]) and math.isnan(out[0]["tau_std"])
    assert out[0]["identical_to_ar"] == 1.0 and out[1]["identical_to_ar"] == 0.0
    assert "method" not in out[0]
    nothing = uniform_metrics([{"method": "a", "x": None}, {"method": "b", "x": None}])
    assert [list(m) for m in nothing] == [["x"], ["x"]]  # a column that never applies
    assert "tau" not in uniform_metrics(ROWS, skip=("tau",))[0]


def test_one_child_per_row_with_method_params_and_acceptance_steps():
    parent = Recorder("smoke-evaluate")
    params = [{"name": "ar", "label": "ar"},
              {"name": "chain", "label": "chain(gamma=2)", "gamma": 2}]
    log_child_runs(parent, ROWS, params, tags={"loss": "talf"})
    assert [c.run_name for c in parent.children] == ["ar", "chain"]  # short: one chain
    chain = parent.children[1]
    assert chain.config == {"method": params[1]}  # logged as method.name, method.gamma
    assert chain.tags == {"kind": "method", "method": "chain(gamma=2)", "loss": "talf",
                          "mlflow.runColor": RUN_COLORS[1]}  # a colour of its own
    assert parent.children[0].tags["mlflow.runColor"] == RUN_COLORS[0] != RUN_COLORS[1]
    assert parent.children[0].duration == 2.5  # the run lasts its decoding time
    assert not hasattr(chain, "duration")  # a row without decode_s: left as logged
    [(flat, step)] = chain.metrics
    assert flat["tau"] == 1.5 and step is None
    assert flat["summary/tau"] == 1.5 and flat["summary/speedup"] == flat["speedup"]
    assert not [k for k in flat if k.startswith("summary/")
                and k.removeprefix("summary/") not in flat]
    assert chain.series == ("acceptance_at_least", {k: 0.5 / k for k in range(1, 7)})
    loss = parent.child("compare-talf", {})
    loss.nested = True  # a child run itself: its methods carry its name
    log_child_runs(loss, ROWS, params)
    assert [c.run_name for c in loss.children] == ["compare-talf/ar", "compare-talf/chain"]
    with pytest.raises(ValueError, match="2 rows but 1"):
        log_child_runs(parent, ROWS, params[:1])


def test_child_run_names_keep_only_the_knobs_that_tell_runs_apart():
    from speclab.pipelines.method_runs import method_params, short_run_names

    ps = [method_params("ar", "ar", {}),
          method_params("chain(gamma=2)", "chain", {"gamma": 2}),
          method_params("chain(gamma=4)", "chain", {"gamma": 4}),
          method_params("salf(batch=4,depth=6,nodes=16,salf_threshold=0.2)", "salf",
                        {"batch": 4, "depth": 6, "nodes": 16, "salf_threshold": 0.2}),
          method_params("my tree", "tree", {"nodes": 8})]  # a label given by hand
    assert short_run_names(ps, [""] * 5) == ["ar", "chain(gamma=2)", "chain(gamma=4)",
                                             "salf", "my tree"]
    twice = [method_params("pld", "pld", {}), method_params("x", "chain", {}),
             method_params("pld", "pld", {})]
    assert short_run_names(twice, [""] * 3) == ["pld", "x", "pld"]  # full labels kept


def test_best_metrics_name_the_best_row():
    parent = Recorder()
    log_best(parent, ROWS, "eval/")
    assert parent.metrics[0][0] == {"eval/best_speedup": 1.2, "eval/best_tau": 1.5,
                                    # the same under summary/: the chart view leads with them
                                    "summary/eval/best_speedup": 1.2,
                                    "summary/eval/best_tau": 1.5}
    assert parent.tags["eval/best_tau_method"] == "chain(gamma=2)"


def test_long_labels_are_wrapped_not_cut():
    label = "salf(batch=4,depth=10,nodes=60,salf_threshold=0.3,score_temperature=0.5)"
    wrapped = wrap_label(label)
    assert wrapped.replace("\n", "") == label
    assert all(len(line) <= 30 for line in wrapped.splitlines())
    assert wrap_label("ar") == "ar"


def test_evaluation_figures_have_titles_units_and_error_bars():
    rows = [{**r, "prompts": 4, "tokens_per_s": 10.0 * (i + 1), "speedup_std": 0.1,
             "tokens_per_s_std": 1.0, "predicted_speedup": 1.1}
            for i, r in enumerate(ROWS + [{**ROWS[1], "method": "chain(gamma=4)"}])]
    figs = method_figures(rows, [2, 4])
    assert set(figs) == {"tau_per_method.png", "tokens_per_s.png", "speedup_per_method.png",
                         "acceptance_per_position.png", "speedup_vs_gamma.png"}
    for name, fig in figs.items():
        ax = fig.axes[0]
        assert "4 prompts" in ax.get_title(), name
        assert ax.get_xlabel(), name  # every axis says what it measures, in what unit
        if name in ("acceptance_per_position.png", "speedup_vs_gamma.png"):
            assert ax.get_ylabel(), name
    speed = figs["speedup_per_method.png"].axes[0]
    bars = next(c for c in speed.containers if hasattr(c, "errorbar"))
    assert bars.errorbar is not None  # whiskers: ±1 sd over prompts
    assert "sd of per-prompt values" in speed.get_xlabel() and "x AR" in speed.get_xlabel()
    assert [r["method"] for r in acceptance_table(rows)] == ["chain(gamma=2)",
                                                           "chain(gamma=4)"]

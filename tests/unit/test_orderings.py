"""The papers' orderings on paired prompts (speclab.orderings) and their place in a loss
comparison's logged table (speclab.pipelines.comparison.log_comparison)."""

import math

import pytest

from speclab.evaluation import ACCEPT_POSITIONS
from speclab.orderings import (
    PAPER_ORDERINGS,
    Ordering,
    difference_cell,
    ordering_rows,
    paired_difference,
    paired_speedup,
    speedups_cell,
)
from speclab.paired_timing import Pair, median_interval, unit_speedups
from speclab.pipelines.comparison import log_comparison


def test_a_uniform_gain_holds_with_an_interval_of_that_gain():
    below = [1.2 + 0.05 * i for i in range(20)]
    above = [t * 1.1 for t in below]
    got = paired_difference(below, above)
    assert got["verdict"] == "holds"
    assert got["difference"] == pytest.approx(0.1)
    assert got["difference_lo"] == pytest.approx(0.1)
    assert got["difference_hi"] == pytest.approx(0.1)
    assert got["tau_ratio"] == pytest.approx(1.1)
    assert got["prompts"] == 20 and got["coverage"] >= 0.95


def test_the_interval_is_the_order_statistics_interval_of_the_ratios():
    below = [2.0] * 12
    above = [2.0 * (1 + d) for d in (-0.3, -0.2, -0.1, 0.0, 0.05, 0.1, 0.15, 0.2, 0.25,
                                     0.3, 0.35, 0.4)]
    got = paired_difference(below, above)
    lo, hi, coverage = median_interval([a / b for a, b in zip(above, below, strict=True)])
    assert got["difference_lo"] == pytest.approx(lo - 1)
    assert got["difference_hi"] == pytest.approx(hi - 1)
    assert got["coverage"] == coverage
    assert got["difference_lo"] < 0 < got["difference_hi"]
    assert got["verdict"] == "unresolved"  # a spread gain on 12 prompts does not resolve


def test_a_loss_on_every_prompt_fails():
    below = [1.5 + 0.1 * i for i in range(16)]
    above = [t - 0.2 for t in below]
    got = paired_difference(below, above)
    assert got["verdict"] == "fails" and got["difference_hi"] < 0
    assert got["tau_ratio"] < 1


def test_missing_prompts_are_left_out_of_both_sides_and_unequal_sets_are_refused():
    got = paired_difference([1.0, math.nan, 2.0], [1.5, 3.0, math.nan])
    assert got["prompts"] == 1 and got["difference"] == pytest.approx(0.5)
    empty = paired_difference([], [])
    assert empty["prompts"] == 0 and empty["verdict"] == "unresolved"
    assert difference_cell(empty) == "-"
    with pytest.raises(ValueError, match="same prompts"):
        paired_difference([1.0, 2.0], [1.0])


def _table():
    taus = {"eagle": [1.5, 1.6, 1.4, 1.7, 1.5, 1.6, 1.5, 1.4],
            "hass": [1.7, 1.8, 1.5, 1.9, 1.6, 1.8, 1.7, 1.6]}
    rows = []
    for loss, per in taus.items():
        for method in ("tree", "chain"):
            rows.append({"loss": loss, "method": method, "tau": sum(per) / len(per),
                         "tau_per_prompt": per, "target_calls_per_token": 0.6,
                         "speedup": 1.0, "tau_std": 0.1,
                         **{f"accept_at_{k}": 0.5 / k for k in range(1, ACCEPT_POSITIONS + 1)}})
    return rows


def test_ordering_rows_pair_the_drafters_a_table_holds_per_method():
    rows = ordering_rows(_table())
    # only HASS over EAGLE has both sides here (no talf, eagle3 or medusa rows)
    assert [(r["above"], r["below"], r["method"]) for r in rows] == [
        ("hass", "eagle", "tree"), ("hass", "eagle", "chain")]
    assert all(r["verdict"] == "holds" for r in rows)  # HASS above on all 8 prompts
    assert rows[0]["claim"] == PAPER_ORDERINGS[0].claim
    assert ordering_rows(_table(), orderings=[Ordering("talf", "eagle", "x")]) == []


class _Recorder:
    def __init__(self):
        self.tables, self.metrics, self.texts = {}, {}, {}

    def log_table(self, rows, name):
        self.tables[name] = rows

    def log_metrics(self, metrics, step=None):
        self.metrics.update(metrics)

    def log_text(self, text, name):
        self.texts[name] = text

    def log_figure(self, fig, name):
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_a_comparison_logs_its_orderings_beside_its_table():
    rec = _Recorder()
    text = log_comparison(rec, _table())
    assert "the papers' orderings" in text and "holds" in text
    assert [r["verdict"] for r in rec.tables["orderings"]] == ["holds", "holds"]
    assert rec.metrics["ordering_hass_over_eagle_tree"] > 0
    assert "tau_per_prompt" in rec.tables["loss_comparison"][0]
    assert rec.tables["orderings"][0]["speedup_above"] == 1.0  # the rows' speedups
    assert "1.00x / 1.00x" in text
    # a table with no ordering's two sides logs no orderings
    rec2 = _Recorder()
    log_comparison(rec2, [r for r in _table() if r["loss"] == "eagle"])
    assert "orderings" not in rec2.tables and not rec2.metrics


def test_paired_rows_order_an_evaluations_methods_by_label():
    """The evaluate job's ``orderings``: rows found by their ``method`` label; a side
    the table lacks is skipped."""
    from speclab.orderings import paired_rows

    table = [{"method": "ar", "tau": 1.0, "tau_per_prompt": [1.0] * 6},
             {"method": "tree", "tau": 1.8, "tau_per_prompt": [1.5, 1.7, 1.8, 1.9, 2.0, 1.9],
              "speedup": 0.35, "speedup_lo": 0.34, "speedup_hi": 0.38},
             {"method": "chain", "tau": 1.4,
              "tau_per_prompt": [1.4, 1.3, 1.5, 1.4, 1.3, 1.5],
              "speedup": 0.63, "speedup_lo": 0.57, "speedup_hi": 0.71}]
    rows = paired_rows(table, [Ordering("tree", "chain", "trees above chains"),
                               Ordering("salf", "chain", "not in the table")])
    [row] = rows
    assert (row["above"], row["below"], row["claim"]) == ("tree", "chain",
                                                          "trees above chains")
    assert (row["tau_above"], row["tau_below"], row["prompts"]) == (1.8, 1.4, 6)
    expected = paired_difference(table[2]["tau_per_prompt"], table[1]["tau_per_prompt"])
    assert row["difference"] == expected["difference"] and row["verdict"] == "holds"
    # the rows' own speedups beside the tau ordering: here tau and speed disagree
    assert (row["speedup_above"], row["speedup_lo_above"], row["speedup_hi_above"]) == (
        0.35, 0.34, 0.38)
    assert (row["speedup_below"], row["speedup_lo_below"], row["speedup_hi_below"]) == (
        0.63, 0.57, 0.71)
    rec = _Recorder()
    from speclab.pipelines.comparison import log_orderings

    text = log_orderings(rec, rows)
    assert rec.tables["orderings"] == rows and "method" not in text.splitlines()[0]
    assert rec.metrics == {"ordering_tree_over_chain": row["difference"]}
    assert "0.35x / 0.63x" in text.splitlines()[2]
    # rows without speedups (or one side without) give no speedup figures: '-' cell
    bare = paired_rows([{k: v for k, v in r.items() if not k.startswith("speedup")}
                        if r["method"] == "chain" else r for r in table],
                       [Ordering("tree", "chain", "")])
    assert not any(k.startswith("speedup") for k in bare[0])
    assert speedups_cell(bare[0]) == "-"


def test_an_evaluate_config_orders_labelled_methods_only():
    from speclab.config.base import ConfigError
    from speclab.config.jobs import ExperimentConfig

    base = {"job": "evaluate", "methods": [{"name": "chain", "gamma": 2, "label": "c2"},
                                           {"name": "chain", "gamma": 3}]}
    cfg = ExperimentConfig.from_dict({**base, "orderings": [{"above": "c2", "below": "ar"}]})
    assert [(o.above, o.below) for o in cfg.orderings] == [("c2", "ar")]
    with pytest.raises(ConfigError, match=r"orderings\[0\]\.above: 'chain\(gamma=3\)' is no "):
        ExperimentConfig.from_dict({**base, "orderings": [{"above": "chain(gamma=3)",
                                                           "below": "c2"}]})
    with pytest.raises(ConfigError, match=r"orderings\[0\]: above and below"):
        ExperimentConfig.from_dict({**base, "orderings": [{"above": "c2", "below": "c2"}]})
    with pytest.raises(ConfigError, match="decoding.batch_sizes"):
        ExperimentConfig.from_dict({**base, "data": {"num_prompts": 4},
                                    "decoding": {"batch_sizes": [1, 2]},
                                    "orderings": [{"above": "c2", "below": "ar"}]})


def test_a_speedup_ordering_pairs_each_prompts_speedups():
    """EAGLE-3's claim is in speedup: per prompt, the ratio of the two rows' own paired
    speedups; the median with its order-statistics interval and a verdict."""
    below = [0.30 + 0.01 * i for i in range(16)]
    above = [s * (1.3 + 0.01 * (i % 3)) for i, s in enumerate(below)]
    got = paired_speedup(below, above)
    ratios = [a / b for a, b in zip(above, below, strict=True)]
    lo, hi, _ = median_interval(ratios)
    assert got["speedup_ratio"] == pytest.approx(1.31)
    assert (got["speedup_ratio_lo"], got["speedup_ratio_hi"]) == (lo, hi)
    assert got["speedup_verdict"] == "holds" and lo > 1
    assert paired_speedup(above, below)["speedup_verdict"] == "fails"
    spread = paired_speedup([1.0] * 8, [0.8, 0.9, 1.0, 1.05, 1.1, 1.2, 0.95, 1.15])
    assert spread["speedup_verdict"] == "unresolved"
    none = paired_speedup([math.nan, 0.0], [1.0, 1.0])  # no usable prompt
    assert math.isnan(none["speedup_ratio"]) and none["speedup_verdict"] == "unresolved"
    with pytest.raises(ValueError, match="paired_speedup: 2 prompts against 1"):
        paired_speedup([1.0, 1.0], [1.0])


def test_each_prompts_speedup_is_the_median_of_its_pairs_over_passes():
    def pair(unit, k, ar_s, s):
        return Pair(unit, k, ar_s, 10, s, 10)

    pairs = [pair(0, 0, 1.0, 0.5), pair(1, 0, 1.0, 1.0), pair(0, 1, 1.0, 0.25),
             pair(1, 1, 1.0, 2.0), pair(0, 2, 1.0, 1.0), pair(1, 2, 0.0, 1.0),
             pair(-1, 0, 1.0, 0.1)]  # a batched pair: no prompt's
    got = unit_speedups(pairs, 3)
    assert got[0] == 2.0  # median of 2, 4 and 1
    assert got[1] == pytest.approx(0.75)  # median of 1 and 0.5; the pair without time out
    assert math.isnan(got[2])  # prompt 2 has no pair


def test_the_orderings_table_prints_the_paired_speedup_ratio():
    from speclab.orderings import paired_rows
    from speclab.pipelines.comparison import log_orderings

    slow = [0.30 + 0.01 * i for i in range(12)]
    table = [{"method": "eagle3", "tau": 1.6, "tau_per_prompt": [1.6] * 12,
              "speedup": 0.44, "speedup_lo": 0.39, "speedup_hi": 0.51,
              "speedup_per_prompt": [s * 1.34 for s in slow]},
             {"method": "eagle", "tau": 1.6, "tau_per_prompt": [1.6] * 12,
              "speedup": 0.33, "speedup_lo": 0.29, "speedup_hi": 0.38,
              "speedup_per_prompt": slow}]
    [row] = paired_rows(table, [Ordering("eagle3", "eagle", "~1.4x")])
    assert row["verdict"] == "unresolved"  # equal taus
    assert row["speedup_ratio"] == pytest.approx(1.34) and row["speedup_verdict"] == "holds"
    assert speedups_cell(row) == "0.44x / 0.33x = 1.34x [1.34, 1.34] holds"
    rec = _Recorder()
    log_orderings(rec, [row])
    assert rec.metrics["ordering_speedup_eagle3_over_eagle"] == pytest.approx(1.34)

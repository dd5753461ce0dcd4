"""The paired timing protocol (issue 33): its statistics, the protocol on a virtual clock
(a slowed stretch of the run no longer moves a speedup; the speedup and tokens/s columns
never contradict each other beyond the interval without the row saying so), the rows'
new keys, and the engine's overhead against measured forward costs."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from speclab.decoding.loop import GenerationStats
from speclab.evaluation import (
    MethodRun,
    Totals,
    format_table,
    paired_passes,
    pooled_ar,
    summarize,
)
from speclab.forward_costs import CostCurve, CostModel, engine_overhead, monotone
from speclab.paired_timing import (
    AR_SPREAD_BOUND,
    Pair,
    binomial_cdf,
    median,
    median_interval,
    normalize_ar,
    overhead_figures,
    quantile,
    speedup_figures,
)

# ---------------------------------------------------------------- the statistics


def test_median_quantile_and_binomial():
    assert median([3.0, 1.0, 2.0]) == 2.0 and median([4.0, 1.0, 2.0, 3.0]) == 2.5
    assert math.isnan(median([]))
    assert quantile([0.0, 10.0], 0.9) == pytest.approx(9.0)
    assert binomial_cdf(-1, 5) == 0.0 and binomial_cdf(5, 5) == 1.0
    assert binomial_cdf(0, 6) == pytest.approx(1 / 64)


def test_the_interval_is_the_order_statistics_with_at_least_95_percent():
    xs = list(range(1, 7))  # 6 values: [min, max] covers 1 - 2/64
    lo, hi, cov = median_interval(xs)
    assert (lo, hi) == (1, 6) and cov == pytest.approx(1 - 2 / 64)
    lo, hi, cov = median_interval([5.0, 1.0, 3.0])  # too few for 95%: their range
    assert (lo, hi) == (1.0, 5.0) and cov == pytest.approx(0.75)
    lo, hi, cov = median_interval(list(range(100)))
    assert cov >= 0.95 and lo < median(range(100)) < hi
    assert (lo, hi) == (39, 60)  # ranks 40 and 61: the textbook interval for n = 100
    assert 1 - 2 * binomial_cdf(int(lo) + 1, 100) < 0.95  # the narrowest such interval
    assert all(math.isnan(v) for v in median_interval([])[:2])


@pytest.mark.parametrize("n", [8, 30])
def test_the_interval_covers_the_median_95_percent_of_the_time(n):
    """Skewed noise (log-normal ratios, true median 2.0): the interval holds it at least
    as often as it says (distribution-free), over 2000 seeded repetitions."""
    rng = random.Random(7)
    hits = 0
    for _ in range(2000):
        xs = [2.0 * math.exp(rng.gauss(0.0, 0.4)) for _ in range(n)]
        lo, hi, cov = median_interval(xs)
        hits += lo <= 2.0 <= hi
    assert cov >= 0.95
    assert hits / 2000 >= 0.94


def _pairs(ar: list[float], m: list[float], tokens: int = 64) -> list[Pair]:
    return normalize_ar([Pair(i % 4, i // 4, a, tokens, s, tokens)
                         for i, (a, s) in enumerate(zip(ar, m))])


def test_the_ar_spread_flags_a_method_whose_ar_timings_moved():
    quiet = _pairs([1.0, 1.1, 0.9, 1.0] * 3, [0.5, 0.55, 0.45, 0.5] * 3)
    fig = speedup_figures(quiet)
    assert fig["ar_spread"] < AR_SPREAD_BOUND and not fig["noisy"] and fig["timing_note"] == ""
    assert fig["speedup"] == pytest.approx(2.0)
    # the AR halves of one pass in three ran 2x slow (and only those: nothing paired them)
    ar = [1.0] * 4 + [2.0] * 4 + [1.0] * 4
    loud = speedup_figures(_pairs(ar, [0.5] * 12))
    assert loud["ar_spread"] > AR_SPREAD_BOUND and loud["noisy"]
    assert "AR timings spread" in loud["timing_note"]


# ---------------------------------------------------------------- a virtual clock


class Clock:
    """Virtual seconds; ``slow(t)``: how much slower work runs at time ``t``."""

    def __init__(self, slow=lambda t: 1.0) -> None:
        self.t, self.slow = 0.0, slow

    def block(self, work_per_prompt: dict[int, float], tokens: int = 32):
        """A timed block: each prompt's work (seconds at full speed) on this clock."""
        def run(prompts: list[list[int]], first: int) -> Totals:
            totals = Totals()
            for p in prompts:
                dt = work_per_prompt[p[0]] * self.slow(self.t)
                self.t += dt
                totals.add(_result(tokens, dt))
            return totals
        return run


def _result(tokens: int, wall: float):
    from speclab.api import GenerationResult

    stats = GenerationStats(new_tokens=tokens, target_calls=tokens, wall_s=wall,
                            accepted_lengths=[1] * tokens)
    return GenerationResult([0] * tokens, None, stats)


PROMPTS = [[i] for i in range(12)]
AR_WORK = {i: 0.5 + 0.1 * i for i in range(12)}  # longer prompts, slower


def _compare(clock: Clock, speedups: dict[str, float], passes: int = 3,
             ar_work: dict[int, float] = AR_WORK) -> list[dict]:
    blocks = {name: clock.block({i: w / s for i, w in ar_work.items()})
              for name, s in speedups.items()}
    res = paired_passes(blocks, clock.block(ar_work), PROMPTS, passes)
    results = {name: {"totals": t, "ar": a} for name, (t, a) in res.items()}
    ar = pooled_ar(results)
    return [summarize(MethodRun("ar"), ar, ar)] + [
        summarize(MethodRun("chain", {"gamma": int(s)}), *res[name]) for name, s in
        speedups.items()]


def test_a_slowed_stretch_of_the_run_no_longer_moves_the_speedup():
    """Another process takes the CPU (3x slower) for a stretch of the run: with AR and
    the method one after the other per prompt, both halves of the pairs it touches slow
    down together, and every method's speedup stays at its true value, inside its
    interval. The ratio of totals is inside too, unless a pair that straddles the edge of
    the slow stretch (one half slowed, the other not) pulls it out: the row then says so.
    Timing AR and the method as two whole blocks (the old protocol) on the same clock
    moves the figure ~3x."""
    rng = random.Random(3)  # and a few percent of jitter on every block
    clock = Clock(lambda t: (3.0 if 20.0 <= t < 40.0 else 1.0) * rng.uniform(0.97, 1.04))
    rows = _compare(clock, {"a": 2.5, "b": 1.5, "c": 0.8})
    for row, true in zip(rows[1:], (2.5, 1.5, 0.8)):
        assert row["speedup"] == pytest.approx(true, rel=0.02)
        assert row["speedup_lo"] <= true <= row["speedup_hi"]
        inside = row["speedup_lo"] <= row["speedup_totals"] <= row["speedup_hi"]
        assert inside or (row["noisy"] and "ratio of totals" in row["timing_note"])
        assert row["speedup_totals"] == pytest.approx(true, rel=0.1)
        assert row["speedup_pairs"] == 3 * len(PROMPTS) and row["passes"] == 3
    assert rows[0]["speedup"] == 1.0 and rows[0]["passes"] == 9  # every method's AR
    # the old protocol: a whole AR block, then the whole method block, on the same clock
    old = Clock(lambda t: 3.0 if t < 37.9 else 1.0)  # the slowed stretch: the AR block
    ar = old.block(AR_WORK)(PROMPTS, 0)
    m = old.block({i: w / 2.5 for i, w in AR_WORK.items()})(PROMPTS, 0)
    assert ar.wall_s / m.wall_s > 2.5 * 2


def test_the_columns_never_contradict_beyond_the_interval_unflagged():
    """Random clocks (slowed stretches anywhere, jitter) and prompts whose speedups
    differ: ``speedup_totals`` is exactly ``tokens_per_s / ar_tokens_per_s``, and it lies
    inside ``[speedup_lo, speedup_hi]`` unless the row is flagged ``noisy`` with the
    reason. Prompts with very different speedups can legitimately put the ratio of
    totals outside the median's interval: the flag then says so."""
    flagged = 0
    for seed in range(40):
        rng = random.Random(seed)
        start, length, factor = rng.uniform(0, 40), rng.uniform(0, 30), rng.uniform(1, 4)

        def slow(t: float, rng=rng, start=start, length=length, factor=factor) -> float:
            return (factor if start <= t < start + length else 1.0) * rng.uniform(0.95, 1.1)

        clock = Clock(slow)
        spread = rng.choice([0.0, 0.3, 1.5])
        per_prompt = {i: 2.0 * math.exp(spread * rng.gauss(0, 1)) for i in range(12)}
        blocks = {"m": clock.block({i: AR_WORK[i] / per_prompt[i] for i in range(12)})}
        res = paired_passes(blocks, clock.block(AR_WORK), PROMPTS, 3)
        row = summarize(MethodRun("chain"), *res["m"])
        assert row["speedup_totals"] == row["tokens_per_s"] / row["ar_tokens_per_s"]
        inside = row["speedup_lo"] <= row["speedup_totals"] <= row["speedup_hi"]
        assert inside or (row["noisy"] and row["timing_note"])
        if not inside:
            assert "ratio of totals" in row["timing_note"]
            flagged += 1
    assert flagged < 40  # most are consistent


def test_pairs_alternate_the_order_and_span_every_pass():
    order: list[str] = []
    clock = Clock()

    def tagged(name: str, work: dict[int, float]):
        inner = clock.block(work)

        def run(ps, first):
            order.append(name)
            return inner(ps, first)
        return run

    paired_passes({"m": tagged("m", {0: 1.0, 1: 1.0})}, tagged("ar", {0: 2.0, 1: 2.0}),
                  [[0], [1]], passes=2)
    assert order == ["ar", "m", "ar", "m", "m", "ar", "m", "ar"]
    with pytest.raises(ValueError, match="timing_passes"):
        paired_passes({}, clock.block({}), [[0]], passes=0)


def test_batched_pairs_are_one_per_pass_over_the_whole_batch():
    clock = Clock()
    res = paired_passes({"m": clock.block({i: 0.5 for i in range(12)})},
                        clock.block({i: 1.0 for i in range(12)}), PROMPTS, 4, batched=True)
    totals, ar = res["m"]
    assert len(totals.pairs) == 4 and {p.unit for p in totals.pairs} == {-1}
    row = summarize(MethodRun("chain"), totals, ar)
    assert row["speedup"] == pytest.approx(2.0) and row["speedup_pairs"] == 4
    assert row["speedup_coverage"] == pytest.approx(1 - 2 / 16)  # 4 pairs: their range
    assert row["new_tokens"] == 12 * 32 and totals.timed_tokens == 4 * 12 * 32


# ---------------------------------------------------------------- the rows


def test_rows_carry_the_new_keys_with_nan_where_they_do_not_apply():
    from speclab.pipelines.method_runs import uniform_metrics

    rows = _compare(Clock(), {"a": 2.0}, passes=2)
    keys = ("speedup", "speedup_lo", "speedup_hi", "speedup_totals", "speedup_coverage",
            "ar_spread", "noisy", "modelled_s", "engine_overhead", "engine_overhead_lo",
            "engine_overhead_hi", "engine_overhead_totals", "passes")
    for row in rows:
        assert set(keys) <= set(row)
    ar, m = rows
    assert (ar["speedup"], ar["speedup_lo"], ar["speedup_hi"]) == (1.0, 1.0, 1.0)
    assert m["speedup_lo"] <= m["speedup"] <= m["speedup_hi"]
    assert math.isnan(m["modelled_s"]) and math.isnan(m["engine_overhead"])  # not measured
    # hand-built totals (no pairs): the ratio of totals, no interval
    t = Totals()
    t.add(_result(10, 1.0))
    a = Totals()
    a.add(_result(10, 2.0))
    legacy = summarize(MethodRun("chain"), t, a)
    assert legacy["speedup"] == pytest.approx(2.0) and math.isnan(legacy["speedup_lo"])
    assert legacy["noisy"] is False
    metrics = uniform_metrics([*rows, legacy])  # MLflow: the same keys in every child
    assert len({frozenset(x) for x in metrics}) == 1
    assert metrics[0]["noisy"] in (0.0, 1.0) and "timing_note" not in metrics[0]
    table = format_table(rows)
    assert "1.00x [1.00, 1.00]" in table and "2.00x [" in table
    assert table.splitlines()[2].rstrip().endswith("-")  # no reference outputs: "-"


def test_speedup_plots_draw_the_interval():
    from speclab.pipelines.eval_plots import interval_errors, method_figures

    rows = _compare(Clock(lambda t: 1.0 + 0.2 * math.sin(t)), {"a": 2.0, "b": 3.0})
    for r in rows:
        r.update({f"accept_at_{k}": 0.5 for k in range(1, 7)})
    figs = method_figures(rows, [2, 3])
    assert "95% interval" in figs["speedup_per_method.png"].axes[0].get_xlabel()
    values = [r["speedup"] for r in rows[1:]]
    below, above = interval_errors(rows[1:], "speedup", values)
    assert below[0] == pytest.approx(rows[1]["speedup"] - rows[1]["speedup_lo"])
    assert above[1] == pytest.approx(rows[2]["speedup_hi"] - rows[2]["speedup"])
    legend = figs["speedup_vs_gamma.png"].axes[0].get_legend().get_texts()
    assert any("95% interval" in t.get_text() for t in legend)


# ---------------------------------------------------------------- forward costs


def test_cost_curves_interpolate_and_are_non_decreasing():
    noisy = CostCurve({1: [(1, 1.0), (2, 5.0), (4, 1.2), (8, 2.0)],  # 2 tokens: slowed
                       2: [(1, 0.9), (2, 1.5), (4, 1.8), (8, 3.0)]})
    c = monotone(noisy)
    assert c.points[1] == [(1, 0.9), (2, 1.2), (4, 1.2), (8, 2.0)]
    assert c.cost(1, 6) == pytest.approx(1.6)  # between 4 and 8 tokens
    assert c.cost(2, 16) == pytest.approx(5.4)  # beyond the last point: extrapolated
    assert c.cost(1, 8) <= c.cost(2, 8)
    model = CostModel({7: c})
    assert model.seconds(Counter({(7, 1, 8): 3, (9, 1, 1): 5})) == pytest.approx(6.0)
    assert engine_overhead(10.0, 6.0) == pytest.approx(0.4)
    assert math.isnan(engine_overhead(10.0, math.nan)) and math.isnan(engine_overhead(0, 1))


def test_prefills_are_measured_only_at_shapes_the_prompts_can_make():
    from speclab.forward_costs import SMALL, prefill_shapes, token_points

    lengths = [35, 40, 60, 100, 300, 1465]
    tokens = token_points([[0] * n for n in lengths])
    assert tokens[-1] == 1465 and 1024 in tokens
    assert prefill_shapes(lengths, 1, tokens) == tokens  # one row: every prefill
    small = [t for t in tokens if t <= SMALL]
    # 2 rows: two prompts of 300+ tokens make a 2-row prefill of up to 600 (a group pads
    # a row to at most twice its length), none of 1,024
    assert prefill_shapes(lengths, 2, tokens) == small + [64, 128, 256, 512]
    assert prefill_shapes(lengths, 8, tokens) == small  # 6 prompts: no 8-row prefill


def test_modelled_seconds_price_every_forward_a_block_ran(tiny_pair):
    """With a flat made-up curve (1 ms a forward) ``modelled_s`` counts the forwards the
    hooks saw: for AR exactly one per token plus the prefill."""
    from speclab.api import Decoder
    from speclab.evaluation import interleaved_comparison

    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    flat = CostCurve({1: [(1, 1e-3), (64, 1e-3)]})
    costs = CostModel({id(dec.target.model): flat, id(dec.draft.model): flat})
    prompts = [[3, 9, 27], [5, 6, 7, 8]]
    out = interleaved_comparison(dec, [MethodRun("chain", {"gamma": 2})], prompts,
                                 {"max_new_tokens": 8, "timing_passes": 2}, warmup=False,
                                 forward_costs=costs)
    res = out["chain(gamma=2)"]
    ar, m = res["ar"], res["totals"]
    assert ar.modelled_s == pytest.approx(2 * (ar.target_calls + len(prompts)) * 1e-3)
    assert m.modelled_s > 2 * m.target_calls * 1e-3  # draft forwards are priced too
    assert res["costs"] is costs and ar.passes == m.passes == 2
    assert sum(m.shapes.values()) > sum(ar.shapes.values())  # (drafts and verifies)
    # every timed block priced on its own: the pairs add up to the totals
    assert len(m.pairs) == 4
    assert sum(p.modelled_s for p in m.pairs) == pytest.approx(m.modelled_s)
    assert sum(p.ar_modelled_s for p in m.pairs) == pytest.approx(ar.modelled_s)
    row = summarize(MethodRun("chain", {"gamma": 2}), m, ar)
    shares = sorted((p.s - p.modelled_s) / p.s for p in m.pairs)
    assert row["engine_overhead"] == pytest.approx((shares[1] + shares[2]) / 2)
    assert (row["engine_overhead_lo"], row["engine_overhead_hi"]) == (shares[0], shares[-1])
    assert row["engine_overhead_totals"] == pytest.approx(
        (m.wall_s - m.modelled_s) / m.wall_s)


def test_a_stall_moves_the_overhead_of_the_totals_not_the_median():
    """Issue 33: blocks whose forwards cost 0.9 s of 1.0 s (10% the engine's) and one
    block stalled for 3 s by another process: the share of the summed times counts the
    stall as the engine's (30%), the median over blocks does not, and its interval still
    holds 10%; the AR side reads its own blocks; unpriced blocks give NaN."""
    pairs = [Pair(i, 0, 2.0, 10, 1.0, 10, modelled_s=0.9, ar_modelled_s=1.9)
             for i in range(9)]
    pairs.append(Pair(9, 0, 2.0, 10, 4.0, 10, modelled_s=0.9, ar_modelled_s=1.9))
    got = overhead_figures(pairs)
    assert got["engine_overhead"] == pytest.approx(0.1)
    assert got["engine_overhead_lo"] <= 0.1 + 1e-9 <= got["engine_overhead_hi"] + 2e-9
    assert got["engine_overhead_totals"] == pytest.approx(1 - 9 * 0.9 / 13 - 0.9 / 13)
    assert got["engine_overhead_totals"] > 0.3
    ar = overhead_figures(pairs, ar_side=True)
    assert ar["engine_overhead"] == pytest.approx(0.05)
    assert ar["engine_overhead_totals"] == pytest.approx(0.05)
    bare = overhead_figures([Pair(0, 0, 1.0, 5, 1.0, 5)])
    assert all(math.isnan(v) for v in bare.values())


def test_engine_overhead_on_a_tiny_pair(tiny_pair):
    """Measured curves, their rounds spread between the pairs (a few seconds on 2
    cores): every row's ``modelled_s`` > 0 and the engine's share of a chain's wall time
    is in [0, 1) (tiny models: the engine's own Python is a large share); the
    measurements' own forwards are in no block's count; the forwards clocked where they
    ran (``forward_s``) are part of each row's wall time."""
    from speclab.api import Decoder
    from speclab.evaluation import interleaved_comparison

    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    prompts = [[3, 9, 27], [5, 6, 7, 8], [11, 12]]
    run = MethodRun("chain", {"gamma": 3})
    out = interleaved_comparison(dec, [run], prompts, {"max_new_tokens": 12, "timing_passes": 2})
    ar = pooled_ar(out)
    per_pass = out[run.name]["ar"].target_calls + len(prompts)  # a prefill each
    assert sum(out[run.name]["ar"].shapes.values()) == 2 * per_pass
    rows = [summarize(MethodRun("ar"), ar, ar), summarize(run, out[run.name]["totals"],
                                                          out[run.name]["ar"])]
    for row in rows:
        assert row["modelled_s"] > 0
        # clocked in place: the forwards took part of the wall time, never more
        assert 0 < row["forward_s"] < row["wall_s"]
        assert row["engine_clocked"] == pytest.approx(1 - row["forward_s"] / row["wall_s"])
    assert 0.0 <= rows[1]["engine_overhead"] < 1.0
    curves = out[run.name]["costs"].to_dict()
    assert set(curves) == {"target", "draft"} and "32" in curves["target"]["1"]


@pytest.mark.parametrize("version", [1, 3])
def test_an_eagle_drafters_forwards_are_priced(tiny_pair, tmp_path, version):
    """An EAGLE drafter (EAGLE-1/2 or 3) the warm-up loaded gets its own cost curve: its
    forwards in a block are counted by shape and priced, so they are no longer counted
    as the engine's time; the batched engine leaves it unpriced."""
    from speclab.api import Decoder
    from speclab.evaluation import interleaved_comparison
    from speclab.families.eagle.model import EagleModel, save_eagle
    from speclab.families.eagle.model3 import Eagle3Model
    from speclab.models.loading import load_model

    target = load_model(tiny_pair["target"])
    if version == 1:
        model = EagleModel.from_target(target)
    else:
        model = Eagle3Model.from_target(target)
    folder = str(save_eagle(model, tmp_path / "eagle"))
    dec = Decoder.from_pretrained(tiny_pair["target"])
    run = MethodRun("eagle", {"eagle_model": folder, "tree_top_k": 2, "depth": 3, "nodes": 6})
    prompts = [[3, 9, 27, 4, 5], [5, 6, 7, 8, 9, 10]]
    out = interleaved_comparison(dec, [run], prompts, {"max_new_tokens": 8,
                                                       "timing_passes": 1})
    costs, m = out[run.name]["costs"], out[run.name]["totals"]
    eagle = next(mid for mid, name in costs.names.items() if name.startswith("eagle:"))
    assert set(costs.names.values()) == {"target", costs.names[eagle]}
    assert "32" in costs.to_dict()[costs.names[eagle]]["1"]
    drafts = Counter({k: n for k, n in m.shapes.items() if k[0] == eagle})
    assert sum(drafts.values()) >= m.target_calls  # one forward a round, at least
    assert 0 < costs.seconds(drafts) < m.modelled_s
    batched = interleaved_comparison(dec, [run], prompts, {
        "max_new_tokens": 8, "timing_passes": 1, "batch_size": 2})
    assert set(batched[run.name]["costs"].names.values()) == {"target"}


def test_engine_figures_pair_every_prompt_over_passes(tiny_pair):
    """The training probe: same protocol, keys for the interval and the flag."""
    from transformers import AutoModelForCausalLM

    from speclab.config.method import parse_method
    from speclab.decoding.runner import ModelRunner
    from speclab.decoding.sampling import SamplingParams
    from speclab.drafters.registry import BuildContext, build_drafter
    from speclab.train.engine_probe import engine_figures

    target = AutoModelForCausalLM.from_pretrained(tiny_pair["target"]).eval()
    draft = AutoModelForCausalLM.from_pretrained(tiny_pair["close"]).eval()
    cfg = parse_method({"name": "chain", "gamma": 3})

    def make():
        return build_drafter(cfg, BuildContext(ModelRunner(draft), SamplingParams(0.0), None,
                                               {}))

    out = engine_figures(target, make, [[3, 9, 27], [5, 6, 7, 8]], 10, 3, cfg.traits(),
                         passes=2)
    assert out["engine_identical"] == 1.0
    assert out["engine_speedup_lo"] <= out["engine_speedup"] <= out["engine_speedup_hi"]
    assert out["engine_speedup_totals"] > 0 and out["engine_noisy"] in (0.0, 1.0)


def test_the_passes_knob_is_validated():
    from pydantic import ValidationError

    from speclab.config.schema import DecodingConfig

    assert DecodingConfig().timing_passes == 3
    with pytest.raises(ValidationError, match="timing_passes"):
        DecodingConfig(timing_passes=0)


def test_hugging_face_baselines_are_paired_the_same_way(tiny_pair):
    """``bench`` / ``retrieval_eval``'s HF rows: paired with the engine's AR per prompt,
    their forwards priced on the curves (HF's ``generate`` goes through the same hooks)."""
    from speclab.api import Decoder
    from speclab.bench import hf_rows

    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    prompts = [[3, 9, 27], [5, 6, 7, 8]]
    flat = CostCurve({1: [(1, 1e-3), (64, 1e-3)]})
    costs = CostModel({id(dec.target.model): flat})
    reference = [dec.generate(prompt_ids=p, method="ar", max_new_tokens=6).token_ids
                 for p in prompts]
    [(row, outputs)] = hf_rows(dec, {"hf_prompt_lookup": {"prompt_lookup_num_tokens": 2}},
                               prompts, {"max_new_tokens": 6, "timing_passes": 2}, reference,
                               costs)
    assert row["identical_to_ar"] and outputs == reference
    assert row["speedup_pairs"] == 4 and row["passes"] == 2
    assert row["speedup_lo"] <= row["speedup"] <= row["speedup_hi"]
    assert row["speedup_totals"] == row["tokens_per_s"] / row["ar_tokens_per_s"]
    assert row["modelled_s"] > 0 and row["engine_overhead"] < 1


def test_the_cost_rounds_are_spread_over_the_run():
    """:class:`CostSampler` times its rounds a few at a time between the pairs, evenly,
    and exactly as many as asked; the curve is the median per point."""
    from speclab.forward_costs import CostSampler, _Point

    class Runner:
        seconds = 0.0

    runner = Runner()
    ticks = iter([3e-3, 1e-3, 2e-3] * 20)

    def call() -> None:
        runner.seconds += next(ticks)

    sampler = CostSampler.__new__(CostSampler)
    sampler.points, sampler.names, sampler._runners = [_Point(1, 1, 1, runner, call)], \
        {1: "target"}, []
    between = sampler.spread(slots=10, rounds=4)
    seen = []
    for _ in range(10):
        between()
        seen.append(sampler.rounds)
    assert seen == sorted(seen) and seen[-1] == 4 and seen[4] == 2
    few = sampler.spread(slots=2, rounds=5)  # fewer slots than rounds: several per call
    few()
    few()
    assert sampler.rounds == 9
    assert sampler.model().curves[1].points == {1: [(1, pytest.approx(2e-3))]}


def test_forward_recorder_clocks_each_forward_once(tiny_pair):
    """The recorder's clock covers exactly its models' forwards: a forward of a recorded
    model called inside another recorded one is counted but not clocked twice; work
    outside any forward is not clocked; a forward that raises still stops the clock."""
    import time

    from speclab.forward_costs import ForwardRecorder
    from speclab.models.loading import load_model

    model = load_model(tiny_pair["target"])
    ids = torch.tensor([[3, 9, 27]])

    class Outer(torch.nn.Module):
        def forward(self, x):
            time.sleep(0.05)
            return model(input_ids=x)

    outer = Outer()
    with ForwardRecorder([model, outer]) as rec, torch.inference_mode():
        t0 = time.perf_counter()
        outer(ids)
        took = time.perf_counter() - t0
        time.sleep(0.05)  # outside any forward
        counts, seconds = rec.take()
        assert sum(counts.values()) == 2  # the inner forward is counted
        assert 0.05 <= seconds <= took  # but clocked once, with the outer one
        with pytest.raises(IndexError):
            model(input_ids=torch.tensor([[10**9]]))  # out of the vocabulary
        time.sleep(0.3)  # after the raising forward: unclocked if it stopped the clock
        model(input_ids=ids)
        _, seconds = rec.take()
        assert 0 < seconds < 0.3  # (two tiny forwards; CI once took 0.09 s for them)
    assert rec.take()[1] == 0.0

"""Evaluation rows: metric keys within MLflow's limit, acceptance per draft position."""

import math

import pytest

from speclab.api import Decoder
from speclab.decoding.loop import accept_at_least
from speclab.evaluation import MAX_KEY, MethodRun, Totals, summarize


def test_long_method_names_get_short_unique_keys():
    short = MethodRun("chain", {"gamma": 3})
    assert short.key == "chain_gamma3"
    runs = [MethodRun("eagle", {"eagle_model": "/tmp/" + "x" * 300 + f"/run{i}/eagle"})
            for i in range(2)]
    keys = [r.key for r in runs]
    assert all(len(k) <= MAX_KEY for k in keys) and keys[0] != keys[1]
    assert len(f"eval/{keys[0]}.accept_at_6") <= 250  # MLflow's metric-name limit


def test_rows_carry_acceptance_per_draft_position(tiny_pair):
    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    totals, ar = Totals(), Totals()
    stats = []
    for prompt in ([3, 9, 27], [5, 6, 7, 8]):
        res = dec.generate(prompt_ids=prompt, method="chain", gamma=4, max_new_tokens=24)
        totals.add(res)
        stats.append(res.stats)
        ar.add(dec.generate(prompt_ids=prompt, method="ar", max_new_tokens=24))
    row = summarize(MethodRun("chain", {"gamma": 4}), totals, ar)
    for k, want in enumerate(accept_at_least(stats, 6), start=1):
        assert row[f"accept_at_{k}"] == want
    assert row["accept_at_1"] > 0 and row["accept_at_5"] == 0.0  # gamma 4: at most 4
    assert math.isnan(summarize(MethodRun("ar"), ar, ar)["accept_at_1"])  # no draft


def test_rows_carry_the_spread_over_prompts(tiny_pair):
    """``<column>_std`` is the sample standard deviation of each prompt's own figure;
    the speedup pairs each prompt with the same prompt in the AR block."""
    import statistics

    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    totals, ar = Totals(), Totals()
    per_tau, per_speed = [], []
    for prompt in ([3, 9, 27], [5, 6, 7, 8], [11, 12]):
        res = dec.generate(prompt_ids=prompt, method="chain", gamma=3, max_new_tokens=20)
        base = dec.generate(prompt_ids=prompt, method="ar", max_new_tokens=20)
        totals.add(res)
        ar.add(base)
        s = res.stats
        per_tau.append(sum(s.accepted_lengths) / s.target_calls)
        per_speed.append((s.new_tokens / s.wall_s) / (base.stats.new_tokens / base.stats.wall_s))
    row = summarize(MethodRun("chain", {"gamma": 3}), totals, ar)
    assert row["tau_std"] == statistics.stdev(per_tau)
    assert row["tau_per_prompt"] == per_tau  # prompt order: what paired orderings read
    assert row["speedup_std"] == statistics.stdev(per_speed)
    assert "speedup_per_prompt" not in row  # built by hand: no pairs
    assert row["tokens_per_s_std"] > 0
    one = Totals()
    one.add(dec.generate(prompt_ids=[3, 9, 27], method="ar", max_new_tokens=8))
    assert summarize(MethodRun("ar"), one, one)["tau_std"] == 0.0  # one prompt: no spread
    one.batched = True  # one wall time for a whole batch: no wall-clock spread
    batched = summarize(MethodRun("ar"), one, one)
    assert batched["speedup_std"] is None and batched["tokens_per_s_std"] is None


def test_the_comparison_reports_each_pass_and_each_method(tiny_pair):
    """A progress line per timed pass, then per method (what `evaluate` prints between
    start and table)."""
    from speclab.evaluation import interleaved_comparison

    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    lines: list[str] = []
    runs = [MethodRun("chain", {"gamma": 2}), MethodRun("chain", {"gamma": 3})]
    out = interleaved_comparison(dec, runs, [[3, 9, 27], [5, 6, 7]],
                                 {"max_new_tokens": 8, "timing_passes": 2}, warmup=False,
                                 progress=lines.append, forward_costs=False)
    assert len(out) == 2 and len(lines) == 4
    assert lines[0].startswith("pass 1/2: 2 prompts x 2 methods")
    assert ", ETA " in lines[0] and "ETA" not in lines[1]  # the rest at the pace so far
    assert lines[2].startswith("method 1/2 chain(gamma=2): 2 prompts, 16 tokens, ")
    assert lines[3].startswith("method 2/2 chain(gamma=3): ") and "tau " in lines[3]
    assert "speedup " in lines[3] and "x [" in lines[3]  # the median with its interval


def test_accept_at_k_counts_only_rounds_that_could_reach_k():
    """Issue 35, item 8: a final round whose budget left one level, and a round cut at an
    EOS inside its accepted drafts, do not pull ``accept_at_k`` down."""
    from speclab.api import GenerationResult
    from speclab.decoding.loop import GenerationStats
    from speclab.evaluation import MethodRun, Totals, summarize

    # rounds: 4 accepted of budget 60; 3 accepted but EOS kept 1 token; 1 of budget 1
    s = GenerationStats(new_tokens=8, target_calls=3, accepted_lengths=[5, 1, 2],
                        round_accepted=[4, 3, 1], round_reach=[60, 57, 1], wall_s=1.0)
    totals = Totals()
    totals.add(GenerationResult(list(range(8)), None, s))
    row = summarize(MethodRun("chain", {"gamma": 4}), totals, totals)
    assert row["accept_at_1"] == 1.0 and row["accept_at_2"] == 1.0 and row["accept_at_3"] == 1.0
    assert row["accept_at_4"] == 0.5  # the first round only, of the two that could reach 4
    assert accept_at_least([s], 4) == [1.0, 1.0, 1.0, 0.5]
    ar = summarize(MethodRun("ar"), Totals(), Totals())
    assert math.isnan(ar["accept_at_1"])  # no round could reach a draft position


def test_long_method_labels_get_a_short_name_and_a_legend():
    """A table narrower than 270 characters: a label over SHORT_LABEL characters is shown
    by its method's name and the knobs that differ (as the MLflow child runs are named),
    and spelt out under the table."""
    from speclab.evaluation import format_table, short_labels

    tree = "tree(depth=3,nodes=6,score_temperature=1.0,tree_top_k=2)"
    salf = [f"salf(batch={b},depth=5,nodes=8,salf_threshold=0.3,score_temperature=1.0)"
            for b in (2, 4)]
    labels = ["ar", "chain(gamma=2)", tree, *salf]
    assert short_labels(labels) == {tree: "tree", salf[0]: "salf(batch=2)",
                                    salf[1]: "salf(batch=4)"}
    assert short_labels(["ar", "chain(gamma=2)"]) == {}
    assert short_labels(["tree", tree]) == {}  # never equal to another label
    hand = "my own label that is rather long, with (parens"
    assert short_labels([hand, tree]) == {tree: "tree"}  # a hand-given label stays
    text = format_table([{"method": m, "tau": 1.5} for m in labels],
                        [("method", "{}"), ("tau", "{:.2f}")])
    lines = text.splitlines()
    assert [x.split()[0] for x in lines[2:7]] == ["ar", "chain(gamma=2)", "tree",
                                                  "salf(batch=2)", "salf(batch=4)"]
    assert lines[7:] == [f"  tree: {tree}", f"  salf(batch=2): {salf[0]}",
                         f"  salf(batch=4): {salf[1]}"]
    assert max(len(x) for x in lines[:7]) < 30


def test_merged_totals_keep_each_pair_on_its_prompt(tiny_pair):
    """Two actors' shards merged (merge_results): the second shard's pairs move past the
    first shard's prompts, so ``speedup_per_prompt`` lines up with ``tau_per_prompt``."""
    from speclab.evaluation import interleaved_comparison, merge_results

    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    runs = [MethodRun("chain", {"gamma": 2})]
    gen = {"max_new_tokens": 8, "timing_passes": 2}
    parts = [interleaved_comparison(dec, runs, shard, gen, warmup=False,
                                    forward_costs=False)
             for shard in ([[3, 9, 27], [5, 6, 7]], [[11, 12]])]
    merged = merge_results(parts)[runs[0].name]
    totals = merged["totals"]
    assert sorted({p.unit for p in totals.pairs}) == [0, 1, 2]
    assert [p.unit for p in totals.pairs[-2:]] == [2, 2]  # the second shard, both passes
    row = summarize(runs[0], totals, merged["ar"])
    assert len(row["speedup_per_prompt"]) == len(row["tau_per_prompt"]) == 3
    last = [p.ratio for p in parts[1][runs[0].name]["totals"].pairs]
    assert row["speedup_per_prompt"][2] == pytest.approx(sum(last) / 2)  # median of 2

"""Evaluation rows: metric keys within MLflow's limit, acceptance per draft position."""

from speclab.api import Decoder
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
    lengths = []
    for prompt in ([3, 9, 27], [5, 6, 7, 8]):
        res = dec.generate(prompt_ids=prompt, method="chain", gamma=4, max_new_tokens=24)
        totals.add(res)
        lengths += res.stats.accepted_lengths
        ar.add(dec.generate(prompt_ids=prompt, method="ar", max_new_tokens=24))
    row = summarize(MethodRun("chain", {"gamma": 4}), totals, ar)
    for k in range(1, 7):
        want = sum(n - 1 >= k for n in lengths) / len(lengths)
        assert row[f"accept_at_{k}"] == want
    assert row["accept_at_5"] == 0.0  # gamma 4 drafts at most 4 tokens
    assert summarize(MethodRun("ar"), ar, ar)["accept_at_1"] == 0.0


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
    assert row["speedup_std"] == statistics.stdev(per_speed)
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
    assert lines[2].startswith("method 1/2 chain(gamma=2): 2 prompts, 16 tokens, ")
    assert lines[3].startswith("method 2/2 chain(gamma=3): ") and "tau " in lines[3]
    assert "speedup " in lines[3] and "x [" in lines[3]  # the median with its interval

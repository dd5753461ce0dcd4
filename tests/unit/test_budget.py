"""The ``auto`` draft budget (decoding/budget.py) and the calibration it reads
(calibration.py, ``speclab calibrate``)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest
import torch

from speclab.api import Decoder
from speclab.calibration import calibrate, calibration_key, load_calibration
from speclab.decoding.budget import (
    Acceptance,
    AutoBudget,
    RoundCosts,
    RowBudget,
    batch_key,
    judged_counts,
)

PROMPT = [1, 2, 3, 4, 5, 1, 2, 3]


def _linear(base: float, per_token: float):
    return lambda rows, tokens: base * rows ** 0.5 + per_token * tokens


def test_cheap_drafts_and_high_acceptance_draft_deep_and_the_opposite_drafts_none():
    # a memory-bound target (more tokens cost little) and a drafter it agrees with
    cheap = AutoBudget(RoundCosts(_linear(10e-3, 0.1e-3), _linear(0.5e-3, 0.0)), 5,
                       prior=[0.9], warmup=0, plain_probes=0).row()
    assert cheap.choose() == 5
    # a compute-bound target, a costly draft model and a drafter it rarely agrees with
    dear = AutoBudget(RoundCosts(_linear(1e-3, 1e-3), _linear(2e-3, 0.0)), 5, prior=[0.1],
                      warmup=0).row()
    assert dear.choose() == 0
    # the chosen budget never exceeds what the round may draft
    assert cheap.choose(limit=2) == 2
    assert cheap.chosen == [5, 2]


def test_acceptance_is_learned_per_sequence_and_plain_runs_are_probed():
    auto = AutoBudget(RoundCosts(_linear(1e-3, 1e-3)), 4, prior=[0.95], warmup=0,
                      probe_every=3, probe_z=0.0,  # (probes not gated: see below)
                      plain_probes=0).row()
    assert auto.choose() == 4
    for _ in range(30):  # this sequence's drafts are never accepted
        auto.observe(4, 0, 4, 0.006)
    assert auto.q(1) < 0.2
    picks = []
    for _ in range(3):
        picks.append(auto.choose())
        auto.observe(picks[-1], 0, picks[-1], 0.002 + 0.001 * picks[-1])
    assert picks[:2] == [0, 0] and picks[2] > 0  # the third plain round in a row probes
    assert AutoBudget(RoundCosts(_linear(1e-3, 0.0)), 3, warmup=2).row().choose() == 3
    with pytest.raises(ValueError, match="budget"):
        AutoBudget(RoundCosts(_linear(1e-3, 0.0)), 0)


def test_one_decision_per_batch_step_for_every_row():
    """A driver's step: the first row to ask decides, the others share it (a row that
    skips drafting saves nothing while the others draft); each row keeps its own
    acceptance, and a row that ended no longer counts."""
    auto = AutoBudget(RoundCosts(_linear(1e-3, 1e-3)), 4, prior=[0.6], warmup=0,
                      driven=True)
    rows = [auto.row() for _ in range(3)]
    first = [r.choose() for r in rows]
    assert len(set(first)) == 1 and auto.decisions == first[:1]
    for r in rows:
        r.observe(first[0], 0, first[0], 0.004)
    assert [r.choose() for r in rows] == first  # no new step yet: the same decision
    auto.next_step()
    [r.choose() for r in rows]
    assert len(auto.decisions) == 2
    for _ in range(20):  # row 0 accepts everything, the others nothing
        rows[0].observe(4, 4, 4, 0.006)
        rows[1].observe(4, 0, 4, 0.006)
    assert rows[0].q(1) > 0.8 > 0.2 > rows[1].q(1)
    rows[1].close()
    rows[2].close()
    assert len(auto._rows) == 1


def test_wall_time_beyond_the_curves_is_learned_as_a_draft_part_per_depth():
    auto = AutoBudget(RoundCosts(_linear(1e-3, 0.0)), 4, prior=[0.5], warmup=0)
    row = auto.row()
    row.observe(4, 2, 4, 0.003)  # a depth-4 round took 2 ms beyond its 1 ms forward
    assert auto.seconds(4, 1) == pytest.approx(0.003)
    assert auto.seconds(2, 1) == pytest.approx(0.002)  # the draft part, in proportion
    assert auto.seconds(0, 1) == pytest.approx(0.001)  # a plain round has none
    auto._timed = False  # (each observation here stands for a step of its own)
    row.observe(2, 1, 2, 0.0025)  # two depths measured: a line through them
    assert auto.seconds(3, 1) == pytest.approx(0.001 + 0.00175)
    auto._timed = False
    row.observe(0, 0, 0, 0.0015)  # a plain round 1.5x its forward: the target part rises
    assert auto.seconds(0, 1) == pytest.approx(0.0015)  # the first at 1 row: as measured
    auto._timed = False
    row.observe(0, 0, 0, 0.0010)  # then running: the median of the last steps'
    assert auto.seconds(0, 1) == pytest.approx(0.00125)
    # one wall-time outlier among steady steps does not move a running step time; a
    # lasting change does, once it is most of the last ``window`` steps
    steady = AutoBudget(RoundCosts(_linear(1e-3, 0.0)), 1, prior=[0.5], warmup=0,
                        window=5)
    one = steady.row()
    parts = []
    for ms in [3, 4, 3, 40, 4, 3, 9, 9, 9]:
        steady._timed, steady._catching_up = False, False
        one.observe(1, 0, 1, 0.001 + ms * 1e-3)  # a 1-level round: 1 ms of target part
        parts.append(round(steady.draft_s(1, 1) * 1e3, 3))
    assert parts[3:6] == [3.5, 4.0, 4.0]  # the 40 ms step is outvoted
    assert parts[-1] == 9.0  # three 9 ms steps of the last five
    with pytest.raises(ValueError, match="window"):
        AutoBudget(RoundCosts(_linear(1e-3, 0.0)), 1, window=0)
    # rounds (accepted, reach): a position counts where the round reached it with every
    # position before it accepted
    counts = judged_counts([2, 0, 1, 3], [3, 3, 1, 3], 4)
    assert counts == Acceptance([4.0, 2.0, 2.0, 0.0], [3.0, 2.0, 1.0, 0.0])
    assert counts.rates() == pytest.approx([0.75, 1.0, 0.5])


@pytest.fixture
def schedule(monkeypatch):
    """Force every auto budget through a fixed schedule with plain rounds between drafted
    ones (what a controller that changes its mind does), within the round's limit."""
    def choose(self, limit=None):
        cycle = self.__dict__.setdefault("_cycle", itertools.cycle([0, 3, 0, 0, 1, 2, 4]))
        b = min(next(cycle), self.max_depth, limit if limit is not None else self.max_depth)
        self.chosen.append(b)
        return b
    monkeypatch.setattr(RowBudget, "choose", choose)


@pytest.mark.parametrize("method,knobs", [
    ("chain", {"gamma": 4}), ("tree", {"depth": 4, "nodes": 8}),
    ("optimal", {"depth": 4, "nodes": 8}), ("salf", {"depth": 4, "nodes": 8}),
    ("pld", {"ngram": 3}), ("aasd", {})])
def test_auto_never_changes_the_greedy_output_alone_or_batched(tiny_pair, schedule, tmp_path,
                                                               monkeypatch, method, knobs):
    monkeypatch.setenv("SPECLAB_HOME", str(tmp_path / "home"))
    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    prompts = [PROMPT, [7], [5, 6, 7, 8, 5, 6]]
    ar = [dec.generate(prompt_ids=p, method="ar", max_new_tokens=30).token_ids
          for p in prompts]
    for p, ref in zip(prompts, ar, strict=True):
        res = dec.generate(prompt_ids=p, method=method, max_new_tokens=30, budget="auto",
                           **knobs)
        assert res.token_ids == ref
        reach = res.stats.round_reach
        assert 0 in reach[:-1] and max(reach) > 0  # plain rounds between drafted ones
    batched = dec.generate(prompts=prompts, method=method, max_new_tokens=30, budget="auto",
                           **knobs)
    assert [r.token_ids for r in batched] == ar


def test_auto_decodes_faster_or_equal_rounds_on_its_own(tiny_pair, tmp_path, monkeypatch):
    """Unforced: the controller runs, every round's budget is within the method's length,
    the output is plain decoding's, and the calibration it measured was stored."""
    monkeypatch.setenv("SPECLAB_HOME", str(tmp_path / "home"))
    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    ar = dec.generate(prompt_ids=PROMPT, method="ar", max_new_tokens=40)
    res = dec.generate(prompt_ids=PROMPT, method="chain", gamma=3, max_new_tokens=40,
                       budget="auto")
    assert res.token_ids == ar.token_ids
    assert max(res.stats.round_reach) <= 3
    assert load_calibration(dec) is not None
    assert "chain" in dec.acceptance  # the next auto run's prior
    with pytest.raises(ValueError, match="budget"):
        dec.generate(prompt_ids=PROMPT, method="chain", budget="sometimes")


def test_calibration_is_stored_and_reused_until_the_models_change(tiny_pair, tmp_path,
                                                                  monkeypatch):
    monkeypatch.setenv("SPECLAB_HOME", str(tmp_path / "home"))
    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    assert load_calibration(dec) is None
    cal = calibrate(dec, max_rows=2, context=16, repeats=2)
    assert set(cal.curves) == {"target", "draft"}
    assert set(cal.curves["target"]) == {"single", "batched"} and cal.max_rows == 2
    again = load_calibration(dec, rows=2)
    assert again is not None and again.to_dict() == cal.to_dict()
    assert load_calibration(dec, rows=4) is None  # does not cover 4 rows
    costs = again.round_costs(batched=True)
    assert costs.target(2, 8) > 0 and costs.draft(1, 1) > 0
    key = calibration_key(dec)
    # the same models from other folders (a models:/ drafter downloads to a new
    # temporary folder each time) find it: where they were loaded from is not the key
    copy = tmp_path / "elsewhere"
    for role, src in (("target", dec.target.model), ("draft", dec.draft.model)):
        src.save_pretrained(copy / role)
    moved = Decoder.from_pretrained(str(copy / "target"), str(copy / "draft"))
    assert calibration_key(moved) == key and load_calibration(moved, rows=2) is not None
    with torch.no_grad():
        next(dec.draft.model.parameters()).add_(0.01)
    assert calibration_key(dec) != key and load_calibration(dec) is None
    with pytest.raises(ValueError, match="repeats"):
        calibrate(dec, repeats=0)


def test_the_calibrate_command_and_generate_with_an_auto_budget(tiny_pair, tmp_path):
    env = {**os.environ, "SPECLAB_HOME": str(tmp_path / "home")}
    pair = ["--target", tiny_pair["target"], "--draft", tiny_pair["close"]]
    out = subprocess.run([sys.executable, "-m", "speclab.cli", "calibrate", *pair,
                          "--max-rows", "2", "--context", "16", "--repeats", "2"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "target (batched)" in out.stdout and "stored:" in out.stderr
    stored = list((tmp_path / "home" / "calibration").glob("*.json"))
    assert len(stored) == 1 and json.loads(stored[0].read_text())["meta"]["max_rows"] == 2
    runs = {}
    for budget in ("fixed", "auto"):
        out = subprocess.run([sys.executable, "-m", "speclab.cli", "generate", *pair,
                              "--method", "chain", "--gamma", "3", "--prompt-ids",
                              "1,2,3,4,5", "--max-new-tokens", "24", "--budget", budget,
                              "--json"], capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr
        runs[budget] = json.loads(out.stdout.splitlines()[-1])
    assert runs["auto"]["token_ids"] == runs["fixed"]["token_ids"]
    assert max(runs["auto"]["stats"]["round_reach"]) <= 3
    bad = subprocess.run([sys.executable, "-m", "speclab.cli", "calibrate", *pair,
                          "--repeats", "0"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert bad.returncode == 2 and "repeats" in bad.stderr


def test_the_sweep_sets_auto_beside_plain_and_the_best_fixed_run_per_batch_size():
    from speclab.bench import auto_sweep, format_sweep

    def row(bs, method, speedup, tps=100.0, mean=None):
        return {"batch_size": bs, "method": method, "speedup": speedup, "speedup_lo":
                speedup - 0.1, "speedup_hi": speedup + 0.1, "tokens_per_s": tps,
                "budget_mean": mean, "budget_histogram": "0:1 2:3"}
    rows = [row(1, "ar", 1.0, 50.0), row(1, "chain(gamma=1)", 1.2), row(1, "chain(gamma=3)", 1.5),
            row(1, "auto", 1.45, mean=2.5),
            row(8, "ar", 1.0, 300.0), row(8, "chain(gamma=1)", 0.9), row(8, "chain(gamma=3)", 0.7),
            row(8, "auto", 0.98, mean=0.4)]
    sweep = auto_sweep(rows, ["auto"])
    assert [(s["batch_size"], s["best_fixed"]) for s in sweep] == [
        (1, "chain(gamma=3)"), (8, "chain(gamma=1)")]
    assert sweep[0]["auto_over_best_fixed"] == pytest.approx(1.45 / 1.5)
    assert sweep[1]["ar_tokens_per_s"] == 300.0 and sweep[1]["auto_budget_mean"] == 0.4
    table = format_sweep(sweep)
    assert "0.98x [0.88, 1.08]" in table and "chain(gamma=1)" in table


def test_bench_auto_needs_the_batch_sweep(capsys):
    from speclab.cli import main

    assert main(["bench", "--auto"]) == 2
    assert "auto: only with --batch-sizes" in capsys.readouterr().err


def test_a_budget_resumes_what_the_last_one_learned(tiny_pair, tmp_path, monkeypatch):
    auto = AutoBudget(RoundCosts(_linear(1e-3, 0.0)), 4, prior=[0.5])
    row = auto.row()
    assert row.choose() == 4
    row.observe(4, 4, 4, 0.030)  # the row's first draft: its prefill or catch-up is in it
    assert auto.step_ratios == {}  # ... so it teaches no step time
    assert row.choose() == 4
    row.observe(4, 4, 4, 0.003)
    row.close()
    again = AutoBudget(RoundCosts(_linear(1e-3, 0.0)), 4, prior=[0.5]).resume(auto.state())
    assert again.warmup == 0 and again.step_ratios == {(1, 4): pytest.approx(3.0)}
    assert again.q(1) > 0.5  # the ended row's acceptance is the new prior
    monkeypatch.setenv("SPECLAB_HOME", str(tmp_path / "home"))
    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    for _ in range(2):
        dec.generate(prompts=[PROMPT, [7, 8]], method="chain", gamma=3, max_new_tokens=16,
                     budget="auto")
    assert ("chain", 3, True, 2) in dec._budgets
    assert dec.auto_budget(dec.method_config("chain", {"gamma": 3}), True, 2).warmup == 0
    dec.forget_budgets()
    assert dec.auto_budget(dec.method_config("chain", {"gamma": 3}), True, 2).warmup > 0


def test_the_timed_passes_do_not_resume_what_the_warm_up_learned(tiny_pair, tmp_path,
                                                                 monkeypatch):
    """The paired protocol's untimed warm-up pass (first-use costs: on a GPU its first
    launches) is forgotten before the timed passes: the first timed generate of an auto
    method starts from the calibrated costs, later ones resume the timed ones."""
    from speclab.evaluation import MethodRun, interleaved_comparison

    monkeypatch.setenv("SPECLAB_HOME", str(tmp_path / "home"))
    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    events, fresh = [], []
    learned, forget, make = dec._learned, dec.forget_budgets, dec.auto_budget
    monkeypatch.setattr(dec, "_learned", lambda *a: (events.append("learned"), learned(*a)))
    monkeypatch.setattr(dec, "forget_budgets", lambda: (events.append("forget"), forget()))

    def auto_budget(*a, **k):
        b = make(*a, **k)
        fresh.append(b.warmup > 0)
        return b

    monkeypatch.setattr(dec, "auto_budget", auto_budget)
    run = MethodRun("chain", {"gamma": 3, "budget": "auto"})
    interleaved_comparison(dec, [run], [PROMPT, [7, 8]], {"max_new_tokens": 8}, passes=2,
                           forward_costs=False)
    assert events[0] == "learned" and events.count("forget") == 1  # the warm-up's, dropped
    assert fresh[:2] == [True, True] and not all(fresh[2:])  # then resumed


def test_a_budget_of_another_draft_length_starts_afresh(tiny_pair, tmp_path, monkeypatch):
    """What a gamma=4 budget learned is not resumed by a gamma=8 one (nor its acceptance
    per position, which has another length)."""
    monkeypatch.setenv("SPECLAB_HOME", str(tmp_path / "home"))
    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    for gamma in (4, 8, 4):
        res = dec.generate(prompt_ids=PROMPT, method="chain", gamma=gamma,
                           max_new_tokens=16, budget="auto")
        assert max(res.stats.round_reach) <= gamma
    assert {k[1] for k in dec._budgets} == {4, 8}
    state = AutoBudget(RoundCosts(_linear(1e-3, 0.0)), 4).state() | {
        "ended": [[1.0] * 4, [1.0] * 4]}
    assert AutoBudget(RoundCosts(_linear(1e-3, 0.0)), 8).resume(state).q(8) == 0.5


def test_rates_are_expected_tokens_over_step_seconds_for_every_depth():
    # rates() takes every depth's E(d) from one pass per row (expected_all); each must be
    # the product formula sum_j prod_{k<=j} q_k, per row, over T(d), with and without
    # optimism and with the slowest row deciding
    auto = AutoBudget(RoundCosts(_linear(1e-3, 0.2e-3), _linear(0.3e-3, 0.0)), 6,
                      prior=[0.7, 0.5], warmup=0, driven=True)
    rows = [auto.row() for _ in range(3)]
    for step in range(12):
        for i, r in enumerate(rows):
            r.observe(6, (step + i) % 7, 6, 0.004)

    def e(d, key, up=()):
        total, p = 1.0, 1.0
        for k in range(1, d + 1):
            p *= min(auto.q(k, key) + (up[k - 1] if up else 0.0), 1.0)
            total += p
        return total

    keys = [r.key for r in rows]
    for z in (0.0, 2.0):
        up = auto.optimism(z) if z else ()
        want = [sum(e(d, k, up) for k in keys) / auto.seconds(d, 3) for d in range(7)]
        assert auto.rates(z=z) == pytest.approx(want, rel=1e-12)
        assert auto.rates(limit=3, z=z) == pytest.approx(want[:4], rel=1e-12)
    assert [auto.expected_tokens(d, keys[1]) for d in range(7)] == pytest.approx(
        [e(d, keys[1]) for d in range(7)], rel=1e-12)
    auto.backlog = False
    for r, left in zip(rows, (40, 39, 5)):
        r.choose(limit=left)
    lag = auto.laggards()
    assert sorted(lag) == keys[:2]
    want = [min(e(d, k) for k in lag) * 3 / auto.seconds(d, 3) for d in range(7)]
    assert auto.rates() == pytest.approx(want, rel=1e-12)


def test_with_nobody_waiting_the_slowest_row_decides():
    """Offline, once no sequence waits to join, the batch ends with its slowest row: a
    depth that pays on the rows' sum but not for the row with the most tokens left is
    not chosen; while sequences wait, the sum (throughput) decides."""
    auto = AutoBudget(RoundCosts(_linear(1e-3, 0.5e-3)), 4, prior=[0.5], warmup=0,
                      driven=True, plain_probes=0)
    fast, slow = auto.row(), auto.row()
    for _ in range(40):  # the fast row accepts every draft, the slow one none
        fast.observe(4, 4, 4, 0.004)
        slow.observe(4, 0, 4, 0.004)
    fast.choose(limit=10)  # tokens each may still draft: the slow row lags
    slow.choose(limit=50)
    assert auto.laggards() == []  # backlog (the default): the throughput objective
    auto.next_step()
    assert fast.choose(limit=10) > 0
    auto.backlog = False
    assert auto.laggards() == [slow.key]
    auto.next_step()
    assert slow.choose(limit=50) == 0  # drafting would not bring the last row home sooner
    rates = auto.rates()
    assert rates[0] == max(rates)


def test_the_prior_is_as_sure_as_the_rounds_that_measured_it(tiny_pair, tmp_path,
                                                              monkeypatch):
    """A prior measured over many rounds starts the ended rows' counts: its optimistic
    bound is narrow, so no probe is spent where drafting would not pay even at that
    bound; 4 rounds' worth of the same prior leaves it wide. The Decoder keeps the
    counts of every round it ran with a method (an auto run adds its few)."""
    def budget(measured):
        return AutoBudget(RoundCosts(_linear(1e-3, 1e-3)), 2, prior=[0.2], warmup=0,
                          probe_every=2, measured=measured)
    many = budget(Acceptance([500.0, 100.0], [100.0, 30.0]))
    few = budget(None)
    for auto in (many, few):
        auto.row()
    assert many.optimism(2.0)[0] < 0.05 < 0.5 < few.optimism(2.0)[0]
    assert many.q(1) == pytest.approx(0.2)

    def picks(auto):
        row = auto.row()
        out = []
        for _ in range(12):
            out.append(row.choose())
            row.observe(out[-1], 0, out[-1], 0.002 + 0.001 * out[-1])
        return out
    assert max(picks(budget(Acceptance([500.0, 100.0], [100.0, 30.0])))) == 0
    assert max(picks(budget(None))) > 0  # the wide prior probes
    monkeypatch.setenv("SPECLAB_HOME", str(tmp_path / "home"))
    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    dec.generate(prompt_ids=PROMPT, method="chain", gamma=3, max_new_tokens=20)
    first = dec._acceptance_counts["chain"]
    dec.generate(prompt_ids=PROMPT, method="chain", gamma=3, max_new_tokens=20)
    both = dec._acceptance_counts["chain"]
    assert both.judged[0] == 2 * first.judged[0] > 0
    assert dec.acceptance["chain"] == pytest.approx(both.rates(least=4) or both.rates()[:1])
    # a position judged by fewer rounds than the prior weighs is no prior: the last
    # surer one's rate stands in for it (the budget repeats a prior's last position)
    thin = Acceptance([400.0, 1.0, 0.0], [160.0, 0.0, 0.0])
    assert thin.rates() == [0.4, 0.0] and thin.rates(least=4) == [0.4]
    assert AutoBudget(RoundCosts(_linear(1e-3, 0.0)), 3, prior=thin.rates(least=4),
                      measured=thin).q(2) == pytest.approx(1.6 / 5)
    assert dec.auto_budget(dec.method_config("chain", {"gamma": 3}), False)._ended == both


def test_a_probe_drafts_only_the_rows_that_drafted_before_or_one():
    """A probe (plain decoding wins, the interval ran out) drafts on the rows that
    drafted before, or, when no live row did, on the first row to ask: the others stay
    plain (their draft models would pay a prefill). The model's own choices draft every
    row."""
    auto = AutoBudget(RoundCosts(_linear(1e-3, 1e-3)), 2, prior=[0.05], warmup=0,
                      probe_every=2, probe_z=0.0, plain_probes=0, driven=True)
    rows = [auto.row() for _ in range(3)]

    def step() -> list[int]:
        picks = [r.choose() for r in rows]
        auto.next_step()
        for r, p in zip(rows, picks, strict=True):
            r.observe(p, 0, p, 0.002 + 0.001 * max(picks))
        return picks

    out = [step() for _ in range(6)]
    assert [i for i, p in enumerate(out) if any(p)] == [1, 5]  # the probes
    assert out[1][0] > 0 and out[1][1:] == [0, 0]  # nobody drafted before: the first
    assert out[5][0] > 0 and out[5][1:] == [0, 0]  # the row that drafted before
    rows.pop(0).close()
    rows.append(auto.row())
    out = [step() for _ in range(10)]
    probes = [p for p in out if any(p)]
    assert probes and all(p == [probes[0][0], 0, 0] for p in probes)
    # a warm-up where the prior says plain decoding wins: it looks anyway, on one row
    warm = AutoBudget(RoundCosts(_linear(1e-3, 1e-3)), 2, prior=[0.05], warmup=2,
                      plain_probes=0, driven=True)
    trio = [warm.row() for _ in range(3)]
    first = []
    for _ in range(3):
        first.append([r.choose() for r in trio])
        warm.next_step()
        for r, p in zip(trio, first[-1], strict=True):
            r.observe(p, 0, p, 0.002 + 0.001 * max(first[-1]))
    assert first[0][0] > 0 and first[0][1:] == [0, 0] and first[1][1:] == [0, 0]
    assert first[2] == [0, 0, 0]
    # ... unless even optimism loses: a prior measured over 500 rounds at 0.05
    sure = AutoBudget(RoundCosts(_linear(1e-3, 1e-3)), 2, prior=[0.05], warmup=2,
                      plain_probes=0, driven=True,
                      measured=Acceptance([500.0, 25.0], [25.0, 1.0]))
    assert sure.explore() == 0 and warm.probe_z == sure.probe_z > 0
    trio = [sure.row() for _ in range(3)]
    assert [r.choose() for r in trio] == [0, 0, 0]
    keen = AutoBudget(RoundCosts(_linear(1e-3, 0.0)), 2, prior=[0.9], warmup=0,
                      plain_probes=0, driven=True)
    both = [keen.row(), keen.row()]
    assert [r.choose() for r in both] == [2, 2]  # a drafting choice: every row


def test_probes_come_less_often_while_plain_decoding_keeps_winning():
    def probes(z: float) -> list[int]:
        auto = AutoBudget(RoundCosts(_linear(1e-3, 1e-3)), 2, prior=[0.05], warmup=0,
                          probe_every=2, probe_z=z)
        row = auto.row()
        picks = []
        for _ in range(40):
            picks.append(row.choose())
            row.observe(picks[-1], 0, picks[-1], 0.002 + 0.001 * picks[-1])
        return [i for i, p in enumerate(picks) if p > 0]

    # the 2nd, then 4th, 8th, 16th decision of a plain run (at most 8x the interval)
    assert probes(0.0) == [1, 5, 13, 29]
    # gated: a draft at depth 1 pays only with acceptance above 0.5 (T(1) = 1.5 T(0));
    # the first probes find none, and once even the estimate's optimistic bound (2 sd
    # over the rounds behind it) stays below 0.5, no more probes are spent
    assert probes(2.0) == [1, 5]


def test_no_probe_where_even_optimism_loses_and_a_catch_up_is_not_a_draft_cost():
    auto = AutoBudget(RoundCosts(_linear(1e-3, 1e-3)), 2, prior=[0.05], warmup=0,
                      probe_every=2)
    row = auto.row()
    assert auto.optimism(2.0)[0] > 0.5  # the prior alone (4 rounds): wide
    for _ in range(60):  # many rounds that accept nothing: the bound is near 0
        row.observe(2, 0, 2, 0.005)
    assert auto.optimism(2.0)[0] < 0.1 and max(auto.rates(z=2.0)[1:]) < auto.rates()[0]
    auto.next_step()
    # a newcomer with no rounds of its own: the pooled counts (this row's) still say no
    fresh = auto.row()
    assert fresh.q(1) < 0.2 and max(auto.rates(z=2.0)[1:]) < auto.rates()[0]
    tight = auto.optimism(2.0)[0]
    row.close()  # only the newcomer is left; the ended row's rounds still count
    assert auto.optimism(2.0)[0] <= tight
    # a row's drafted round right after a plain round of its own, or its first (batched
    # drafters prefill a row's prompt then), carries the draft model's catch-up: its
    # step's time is not learned, neither where a depth's draft part was measured nor
    # where none was
    timed = AutoBudget(RoundCosts(_linear(1e-3, 0.0)), 2, prior=[0.9], warmup=0,
                       plain_probes=0)
    r = timed.row()
    assert r.choose() == 2 and timed._catching_up  # the row's first draft
    r.observe(2, 2, 2, 0.030)  # 29 ms: its prefill
    assert timed.step_ratios == {}
    assert r.choose() == 2 and not timed._catching_up
    r.observe(2, 2, 2, 0.0015)  # steady: 0.5 ms beyond the forward
    assert r.choose(limit=0) == 0  # a plain round of this row
    r.observe(0, 0, 0, 0.001)
    assert r.choose() == 2 and timed._catching_up
    r.observe(2, 2, 2, 0.010)  # 9 ms: a catch-up over the plain round
    assert timed.draft_s(2, 1) == pytest.approx(0.0005)
    assert r.choose() == 2 and not timed._catching_up
    r.observe(2, 2, 2, 0.0025)  # a steady step moves it: the median of 0.5 and 1.5 ms
    assert timed.draft_s(2, 1) == pytest.approx(0.001)


def test_a_draft_part_is_learned_per_batch_size():
    """A draft part learned at one batch size prices another from the nearest one
    measured, scaled by the draft model's curve, or without one in proportion to the
    rows; a budget that learned its draft part alone (a Serve replica's first client)
    does not carry it unscaled to 16 rows, where it would draft at a loss. A draft part
    is a measured step's time beyond its target part at the ``r0`` in force: where
    ``r0`` is measured later, the step still costs what it was measured to cost."""
    # a drafter without a curve (EAGLE's head in Serve): learned at 1 row, a 3 ms step
    # at depth 4, 2 ms beyond its 1 ms forward
    auto = AutoBudget(RoundCosts(_linear(1e-3, 0.0)), 4, prior=[0.9], warmup=0,
                      plain_probes=0)
    auto._learn("step_ratios", (1, 4), 3.0)  # 3x its 1 ms forward
    assert auto.draft_s(4, 1) == pytest.approx(0.002)
    assert auto.draft_s(2, 1) == pytest.approx(0.001)  # in proportion to depth
    assert auto.draft_s(4, 16) == pytest.approx(0.032)  # in proportion to the rows
    assert auto.draft_s(4, 3) == pytest.approx(0.006)  # from the nearest measured
    auto._learn("step_ratios", (16, 4), 3.5)  # then measured at 16 rows: as measured
    assert auto.draft_s(4, 16) == pytest.approx(0.010)  # (the forward: 4 ms)
    assert auto.draft_s(2, 12) == pytest.approx(0.005 * 12 / 16)  # nearest: 16
    assert auto.draft_s(4, 1) == pytest.approx(0.002)  # 1 row keeps its own
    # with a draft model's curve, scaled by it from the nearest batch size measured
    curved = AutoBudget(RoundCosts(_linear(1e-3, 0.0), _linear(0.5e-3, 0.0)), 4,
                        prior=[0.9], warmup=0)
    curved._learn("step_ratios", (1, 4), 5.0)
    assert curved.draft_s(4, 16) == pytest.approx(0.004 * 4.0)  # the curve's sqrt(16)
    # state and resume keep the batch sizes
    again = AutoBudget(RoundCosts(_linear(1e-3, 0.0)), 4).resume(
        json.loads(json.dumps(auto.state())))
    assert again.step_ratios == auto.step_ratios
    # r0 measured at 16 rows after the step was: a plain step at half its curve; the
    # measured step keeps its 14 ms, its draft part is what the cheaper target leaves
    auto.plain_ratios[16] = 0.5
    assert auto.seconds(4, 16) == pytest.approx(0.014)
    assert auto.draft_s(4, 16) == pytest.approx(0.012)
    assert auto.seconds(0, 16) == pytest.approx(0.002)
    # a budget that learned 2 ms alone: at 16 rows its draft costs 32 ms, more than the
    # tokens it would add are worth (a 16-row forward of 4 ms here), so it decodes plain
    # rows wander over a few sizes (clients joining and leaving): a batch size's steps
    # teach one time, priced at each size by the target's curve
    assert [batch_key(r) for r in (1, 3, 4, 5, 7, 8, 9, 12, 15, 16, 20, 31, 32)] == [
        1, 3, 4, 5, 6, 8, 8, 12, 12, 16, 20, 24, 32]
    pooled = AutoBudget(RoundCosts(_linear(1e-3, 0.0)), 2, prior=[0.9], warmup=0)
    pooled._learn("step_ratios", (12, 2), 2.0)  # learned at 12-15 rows
    assert pooled.step_s(2, 13) == pytest.approx(2.0 * 13 ** 0.5 * 1e-3)
    assert pooled.step_s(2, 15) == pytest.approx(2.0 * 15 ** 0.5 * 1e-3)
    assert pooled.step_s(2, 16) is None and pooled.step_s(1, 15) is None
    lone = AutoBudget(RoundCosts(_linear(1e-3, 0.0)), 4, prior=[0.6], warmup=0,
                      plain_probes=0, driven=True)
    lone._learn("step_ratios", (1, 4), 3.0)
    first = lone.row()
    assert first.choose() > 0  # alone, drafting pays
    first.close()
    rows = [lone.row() for _ in range(16)]
    lone.next_step()
    assert {r.choose() for r in rows} == {0}


def test_both_sides_are_measured_per_batch_size_and_a_changed_batch_teaches_no_time():
    """Before a drafting choice stands at a batch size, a plain step measures r0 there
    (at most ``plain_probes`` tries); a plain step's ratio to its curve is kept per
    batch size (the nearest measured stands in for one not measured); a step that ran
    right after rows joined or left (its one-off costs) and a drafted step right after a
    plain one (the catch-up) teach no step time, not even at a depth never measured."""
    # (r0_doubt 0.1: r0 could be far lower than the estimate, so it is worth measuring;
    # one plain step measures it here)
    auto = AutoBudget(RoundCosts(_linear(1e-3, 0.0)), 2, prior=[0.9], warmup=2, driven=True,
                      r0_doubt=0.1, plain_probes=1)
    rows = [auto.row() for _ in range(4)]

    def step(seconds: float, prefills: bool = False) -> int:
        picks = {r.choose() for r in rows}
        assert len(picks) == 1
        if prefills:  # the driver prefills joining rows in this step (Serve)
            auto.changed()
        auto.next_step()
        for r in rows:
            r.observe(picks.pop() if picks else auto._decision, 1, 2, seconds)
        return auto._decision

    assert step(0.050) == 2  # the first step: rows just joined, nothing learned
    assert auto.step_ratios == {} and auto.plain_ratios == {}
    assert step(0.004) == 2  # a steady drafted step: 2 ms beyond its 2 ms forward
    assert auto.step_ratios == {(4, 2): pytest.approx(2.0)}
    assert step(0.003) == 0  # drafting would win, but r0 at 4 rows is not measured
    assert auto.plain_ratios == {4: pytest.approx(1.5)}
    assert auto.seconds(0, 4) == pytest.approx(0.003)
    assert auto.ratio(3) == auto.ratio(16) == pytest.approx(1.5)  # nearest measured
    auto.plain_ratios[16] = 0.5
    assert auto.ratio(12) == 0.5 and auto.ratio(5) == pytest.approx(1.5)
    # the drafted step after the plain one (a catch-up): its 30 ms are not a draft part
    assert step(0.030) == 2 and auto.step_ratios == {(4, 2): pytest.approx(2.0)}
    rows.pop().close()  # a row leaves: the next step's time is not learned
    before = dict(auto.step_ratios), dict(auto.plain_ratios)
    step(0.040)
    assert (auto.step_ratios, auto.plain_ratios) == before
    step(0.0045)  # then steady again: learned
    assert auto.step_ratios != before[0] or auto.plain_ratios != before[1]
    before = dict(auto.step_ratios), dict(auto.plain_ratios)
    step(0.050, prefills=True)  # a step that prefilled rows joining: not learned
    assert (auto.step_ratios, auto.plain_ratios) == before
    resumed = AutoBudget(RoundCosts(_linear(1e-3, 0.0)), 2).resume(auto.state())
    assert resumed.plain_ratios == auto.plain_ratios and resumed.warmup == 0
    # a batch size whose plain steps all ran on a changed batch: at most plain_tries
    tries = AutoBudget(RoundCosts(_linear(1e-3, 0.0), _linear(0.5e-3, 0.0)), 2, prior=[0.9],
                       warmup=0, driven=True, r0_doubt=0.1, plain_tries=3)
    row = tries.row()
    picks = []
    for _ in range(5):
        picks.append(row.choose())
        tries._churned = tries._step  # (stands for a row joining before every step)
        tries.next_step()
        row.observe(picks[-1], 1, 2, 0.002)
    assert picks == [0, 0, 0, 2, 2] and tries.plain_ratios == {}
    # by default r0 rests on 3 plain steps (their median) before drafting stands: one
    # slow plain step no longer prices every later one
    three = AutoBudget(RoundCosts(_linear(1e-3, 0.0), _linear(0.5e-3, 0.0)), 2, prior=[0.9],
                       warmup=0, driven=True, r0_doubt=0.1)
    row = three.row()
    picks = []
    for seconds in (0.009, 0.003, 0.001, 0.001, 0.002, 0.002):  # (the first: it joined)
        picks.append(row.choose())
        three.next_step()
        row.observe(picks[-1], 1, 2, seconds)
    assert picks[:4] == [0, 0, 0, 0] and picks[4] > 0
    assert three.plain_ratios == {1: pytest.approx(1.0)}


def test_a_plain_step_measures_r0_only_where_it_could_change_the_decision():
    """At a batch size whose ``r0`` is not measured, a plain step measures it first only
    where plain decoding would win with ``r0`` at ``r0_doubt`` (0.7) times the estimate
    in use (a batch size within a factor of 2 measured); where drafting wins even then,
    it drafts at once. With none measured that near, it measures."""
    def first(draft_per_level: float, measured_at: int | None) -> int:
        auto = AutoBudget(RoundCosts(_linear(1e-3, 0.0), _linear(draft_per_level, 0.0)), 2,
                          prior=[0.9], warmup=0, driven=True)
        if measured_at is not None:  # r0 measured there, as the curve says
            auto.plain_ratios[measured_at] = 1.0
        return auto.row().choose()

    # 0.05 ms a level against a 1 ms step: depth 2 ahead 2.5x, and still at 0.7 r0
    assert first(0.05e-3, 2) == 2
    # 0.7 ms a level: depth 2 ahead by 13% (1129 against 1000 tokens/s), but at 0.7 r0
    # plain decoding wins (1429 against 1357 at depth 1): measure r0 first
    assert first(0.7e-3, 2) == 0
    # with r0 measured only at 4 rows (or none), its estimate at 1 row is a guess: a
    # plain step measures it even where drafting wins by 2.5x
    assert first(0.05e-3, 4) == 0
    assert first(0.05e-3, None) == 0


def test_a_run_of_one_drafting_choice_is_probed_deeper():
    """The model drafts 1 level in every step (levels 2+ never judged: their acceptance
    is the prior's guess); after ``probe_every`` such decisions one step drafts at the
    depth optimism favours, as a probe, and the next waits twice as long while the model
    keeps its choice. A run the optimistic bound agrees with is never probed."""
    def picks(prior: list[float], z: float = 2.0) -> tuple[list[int], list[int]]:
        auto = AutoBudget(RoundCosts(_linear(1e-3, 1e-4), _linear(3e-4, 0.0)), 3,
                          prior=prior, warmup=0, plain_probes=0, probe_z=z)
        row = auto.row()
        out, probes = [], []
        for i in range(60):
            out.append(row.choose())
            if auto._probing:
                probes.append(i)
            # position 1 always accepted, position 2 never
            row.observe(out[-1], min(out[-1], 1), out[-1], 1.2e-3 + 3e-4 * out[-1])
        return out, probes

    out, probes = picks([0.9, 0.3])
    assert probes == [15, 47] and all(out[i] > 1 for i in probes)
    assert all(p == 1 for i, p in enumerate(out) if i not in probes)
    _, none = picks([0.9, 0.3], z=0.0)  # no optimism: nothing to look for
    assert none == []

"""Timed figures mean the same on a CPU as on a GPU: the clock helper and peak GPU memory
off CUDA, the fast path's warm-up kept out of a generate's figures, the engine figures'
untimed warm-up, and Serve's target time split into the forward and the rest."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import torch

from speclab.api import Decoder
from speclab.config.method import parse_method
from speclab.decoding.runner import ModelRunner
from speclab.decoding.sampling import SamplingParams
from speclab.drafters.registry import BuildContext, build_drafter
from speclab.timing import max_mb, now, peak_gpu_mb, reset_peak_gpu, split_forward_time

from .test_engine_greedy import prompts


def test_clock_and_peak_gpu_memory_off_cuda():
    """No CUDA here: the clock reads at once, the peak is NaN, nothing raises."""
    for device in (None, "cpu", torch.device("cpu")):
        a = now(device)
        assert now(device) >= a
        reset_peak_gpu(device)
        assert math.isnan(peak_gpu_mb(device))
    assert max_mb(math.nan, 3.0) == 3.0 and max_mb(2.0, math.nan) == 2.0
    assert max_mb(2.0, 5.0) == 5.0 and math.isnan(max_mb(math.nan, math.nan))


def test_split_forward_time_counts_only_the_runners_forwards(tiny_pair):
    """``model_s`` is the runner's own forward clock over the call; the rest of the
    call's wall time (here a sleep standing for rules and loops) is ``rest_s``."""
    from transformers import AutoModelForCausalLM

    runner = ModelRunner(AutoModelForCausalLM.from_pretrained(tiny_pair["target"]).eval())
    runner.forward(torch.tensor([1, 2, 3]))  # the process's first forward initialises lazily

    def work():
        runner.forward(torch.tensor([4]))
        time.sleep(0.2)
        return "done"

    s0 = runner.seconds
    t0 = time.perf_counter()
    out, model_s, rest_s = split_forward_time(runner, work)
    wall = time.perf_counter() - t0
    assert out == "done" and runner.calls == 2
    assert model_s == runner.seconds - s0 and 0 < model_s < 0.2
    assert rest_s >= 0.2 and model_s + rest_s <= wall


def test_the_evaluation_blocks_carry_peak_gpu_memory(tiny_pair):
    """Every row (JSON, MLflow metrics) has ``peak_gpu_mb``: NaN off CUDA."""
    from speclab.evaluation import MethodRun, run_prompts, summarize

    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    totals = run_prompts(dec, MethodRun("chain", {"gamma": 2}), prompts(2), {"max_new_tokens": 6})
    row = summarize(MethodRun("chain", {"gamma": 2}), totals, totals)
    assert "peak_gpu_mb" in row and math.isnan(row["peak_gpu_mb"])


# ---------------------------------------------------------------- the fast path's warm-up
SLOW = 100.0  # seconds a pretend compile of each new shape takes (on a virtual clock)


@pytest.fixture
def slow_compiles(monkeypatch):
    """The fast path on an eager static cache that pretends to compile: the first forward
    of each new shape advances every ``time.perf_counter`` reader by ``SLOW`` seconds
    (what compiling costs, without the wait); later forwards of that shape do not."""
    import speclab.api as api
    from speclab.decoding.static_runner import FastPath

    real, skipped = time.perf_counter, [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: real() + skipped[0])

    def make(model, rows, capacity, **kwargs):
        fast = FastPath(model, rows, capacity, compile=False, **kwargs)
        fast.compiled = True
        step, seen = fast.step, set()

        def step_once_slow(ids, pos, mask, *extra):
            if tuple(ids.shape) not in seen:
                seen.add(tuple(ids.shape))
                skipped[0] += SLOW
            return step(ids, pos, mask, *extra)

        fast.step = step_once_slow
        return fast

    monkeypatch.setattr(api, "FastPath", make)


def test_fast_path_warmup_is_kept_out_of_the_timed_figures(tiny_pair, slow_compiles):
    """The first generate compiles its shapes: that time is ``warmup_s`` only; its timed
    figures (the row's and the batch's) are those of the second, identical generate,
    which has no warm-up at all. Outputs equal eager decoding (the repeated warm-up
    forwards change nothing)."""
    plain = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    fast = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"], compile=True)
    p = prompts(1)[0]
    kw = {"method": "chain", "gamma": 3, "max_new_tokens": 12}
    first = fast.generate(prompt_ids=p, **kw)
    warm, first_batch = fast.last_warmup_s, fast.last_batch
    assert warm >= 2 * SLOW and fast.warmup_s == pytest.approx(warm)  # target and draft shapes
    second = fast.generate(prompt_ids=p, **kw)
    assert fast.last_warmup_s == 0.0 and fast.warmup_s == pytest.approx(warm)
    assert first.token_ids == second.token_ids == plain.generate(prompt_ids=p, **kw).token_ids
    for a, b in ((first.stats, second.stats), (first_batch, fast.last_batch)):
        assert 0 < a.wall_s < b.wall_s + SLOW  # with the warm-up it would be >= b + 2 SLOW
        assert a.draft_s < b.draft_s + SLOW and a.verify_s < b.verify_s + SLOW


def test_fast_path_warmup_leaves_every_rows_figures(tiny_pair, slow_compiles):
    """Several rows, one joining later (continuous batching): each row's timed figures
    exclude the warm-ups that ran while it was decoding."""
    fast = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"], compile=True)
    ps = prompts(3)
    kw = {"method": "chain", "gamma": 2, "max_new_tokens": 10, "batch_size": 2}
    first = fast.generate(prompts=ps, **kw)
    assert fast.last_warmup_s >= 2 * SLOW
    second = fast.generate(prompts=ps, **kw)
    assert fast.last_warmup_s == 0.0
    for a, b in zip(first, second, strict=True):
        assert a.token_ids == b.token_ids
        assert 0 < a.stats.wall_s < b.stats.wall_s + SLOW


# ---------------------------------------------------------------- engine figures (training)
def test_engine_figures_warm_up_before_anything_is_timed(tiny_pair, monkeypatch):
    """The probe's untimed warm-up pass runs before the first clock read, and the timed
    passes' forwards (between the clock reads) are all the others; the figures are those
    of the timed passes alone."""
    from transformers import AutoModelForCausalLM

    import speclab.train.engine_probe as probe
    from speclab.decoding.loop import generate_tokens
    from speclab.decoding.rules import resolve_rule

    target = AutoModelForCausalLM.from_pretrained(tiny_pair["target"]).eval()
    draft = AutoModelForCausalLM.from_pretrained(tiny_pair["close"]).eval()
    cfg = parse_method({"name": "chain", "gamma": 3})
    greedy = SamplingParams(0.0)

    def make():
        return build_drafter(cfg, BuildContext(ModelRunner(draft), greedy, None, {}))

    forwards = [0]
    target.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    reads: list[int] = []

    def clock(device=None):
        reads.append(forwards[0])
        return now(device)

    monkeypatch.setattr(probe, "now", clock)
    ps = prompts(2)
    figures = probe.engine_figures(target, make, ps, 12, 3, cfg.traits(), passes=1)
    warmup = reads[0]
    assert warmup > 0  # the warm-up's forwards ran before the first clock read
    assert len(reads) == 3 * len(ps)  # start, AR done, SD done: per prompt
    timed = sum(reads[3 * i + 2] - reads[3 * i] for i in range(len(ps)))
    assert timed == forwards[0] - warmup  # every other forward is in a timed pass
    assert all(reads[3 * i + 3] == reads[3 * i + 2] for i in range(len(ps) - 1))
    lengths = []
    for p in ps:  # the figures: the timed passes' alone
        _, stats = generate_tokens(ModelRunner(target), make(), p, 12, greedy,
                                   resolve_rule(None, None, greedy), traits=cfg.traits())
        lengths += stats.accepted_lengths
    assert figures["engine_tau"] == sum(lengths) / len(lengths)
    assert figures["engine_identical"] == 1.0


# ---------------------------------------------------------------- Serve: target time split
def test_serve_target_time_splits_the_forward_from_the_rest(tiny_pair, monkeypatch):
    """A verify batch's ``target_model_s`` is the target forward alone (the runner's
    clock); the host work after it (each row's pruning, slowed down here) is
    ``target_rule_s``. Plain decoding driven by the target replica reports the forward
    as ``target_model_s`` and the forward plus the rest as ``target_call_s`` (no hop)."""
    from serve_apps.decode import DecodeRequest, collect
    from serve_apps.target import TargetDeployment, _Starts, _Verifies
    from speclab.decoding.rules import RuleSpec

    delay = 0.05
    dep = TargetDeployment(tiny_pair["target"], batch_wait_ms=0.0)
    keep = dep.pool.runner.keep

    def slow_keep(*args, **kwargs):  # host work after the forward (not a forward)
        time.sleep(delay)
        return keep(*args, **kwargs)

    monkeypatch.setattr(dep.pool.runner, "keep", slow_keep)
    row = {"rid": "r0", "prompt_ids": [3, 9, 27], "sampling": {"temperature": 0.0},
           "rule": RuleSpec("greedy").to_dict(), "seed": 0}

    async def one_batch():
        await dep._run([_Starts("src", [row], 0, False)])
        s0 = dep.pool.runner.seconds
        reply = (await dep._run([_Verifies("src", [("r0", None)])]))[0][0]
        return reply, dep.pool.runner.seconds - s0

    reply, forward_s = asyncio.run(one_batch())
    assert "verdict" in reply and reply["rows"] == 1
    assert reply["target_model_s"] == pytest.approx(forward_s)
    assert reply["target_model_s"] < delay <= reply["target_rule_s"]

    req = DecodeRequest([3, 9, 27], 4, {"temperature": 0.0}, RuleSpec("greedy").to_dict(), 0,
                        [], drafting=False)
    out = asyncio.run(collect(dep.generate("k", "r1", req.__dict__)))
    timing = out["stats"]["timing"]
    assert len(out["tokens"]) == 4 and timing["rounds"] == 4
    assert timing["target_model_s"] < 4 * delay
    assert timing["target_call_s"] >= timing["target_model_s"] + 4 * delay

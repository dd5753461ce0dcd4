"""Timed figures on CUDA (skipped without a GPU): the clock waits for the device, the
compiled fast path's warm-up (compiling, capturing CUDA graphs) stays out of a
generate's figures, peak GPU memory is measured, the engine probe and Serve's split
run on the device."""

import math
import time

import pytest
import torch

from speclab.api import Decoder
from speclab.timing import now, peak_gpu_mb, reset_peak_gpu

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_the_clock_waits_for_the_device_and_the_peak_is_measured():
    x = torch.randn(4096, 4096, device="cuda")
    reset_peak_gpu("cuda")
    now("cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(20):
        x = x @ x / 64
    end.record()
    host = now("cuda") - t0
    assert end.query()  # the clock read after the kernels ran
    assert host >= 0.9 * start.elapsed_time(end) / 1000
    peak = peak_gpu_mb("cuda")
    assert math.isfinite(peak) and peak >= 64  # a 4096 x 4096 float32 product: 64 MiB
    assert math.isfinite(peak_gpu_mb())  # None: the device this process used


def test_compiled_warmup_is_reported_apart_and_a_second_generate_has_none(tiny_pair):
    """The first generate compiles and captures its shapes: ``last_warmup_s``; its timed
    figures are those of decoding alone. The second, identical generate warms nothing
    up and takes about as long as the first's timed figure."""
    plain = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"], device="cuda")
    fast = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"], device="cuda",
                                   compile=True)
    kw = {"prompt_ids": [3, 9, 27, 5], "method": "chain", "gamma": 3, "max_new_tokens": 24}
    first = fast.generate(**kw)
    warm = fast.last_warmup_s
    assert warm > 0 and fast.warmup_s == pytest.approx(warm)
    second = fast.generate(**kw)
    assert fast.last_warmup_s == 0.0 and fast.warmup_s == pytest.approx(warm)
    assert first.token_ids == second.token_ids == plain.generate(**kw).token_ids
    # compiling takes seconds, decoding 24 tokens of a tiny model milliseconds
    assert first.stats.wall_s < warm / 2
    assert first.stats.wall_s < 5 * second.stats.wall_s + 0.05
    rows = fast.generate(prompts=[[3, 9, 27, 5], [7, 1]], method="chain", gamma=3,
                         max_new_tokens=24)
    assert rows[0].token_ids == first.token_ids  # a new shape (2 rows) warmed up too
    assert fast.last_batch.wall_s < fast.last_warmup_s / 2


def test_evaluation_and_bench_rows_carry_a_finite_peak_gpu_mb(tiny_pair):
    from speclab.evaluation import MethodRun, run_prompts, summarize

    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"], device="cuda")
    run = MethodRun("chain", {"gamma": 3})
    totals = run_prompts(dec, run, [[3, 9, 27], [5, 6, 7, 8]], {"max_new_tokens": 16})
    row = summarize(run, totals, totals)
    assert math.isfinite(row["peak_gpu_mb"]) and row["peak_gpu_mb"] > 0


def test_hf_generate_timing_waits_for_the_device(tiny_pair):
    from speclab.bench import hf_generate_totals

    dec = Decoder.from_pretrained(tiny_pair["target"], device="cuda")
    tot = hf_generate_totals(dec, [[3, 9, 27], [5, 6, 7, 8]], 8)
    assert tot.new_tokens == 16 and tot.wall_s > 0
    assert math.isfinite(tot.peak_gpu_mb) and tot.peak_gpu_mb > 0


def test_engine_figures_on_cuda(tiny_pair):
    from speclab.config.method import parse_method
    from speclab.decoding.runner import ModelRunner
    from speclab.decoding.sampling import SamplingParams
    from speclab.drafters.registry import BuildContext, build_drafter
    from speclab.models.loading import load_model
    from speclab.train.engine_probe import engine_figures

    target = load_model(tiny_pair["target"], "float32", "cuda")
    draft = load_model(tiny_pair["close"], "float32", "cuda")
    cfg = parse_method({"name": "chain", "gamma": 3})

    def make():
        return build_drafter(cfg, BuildContext(ModelRunner(draft), SamplingParams(0.0), None,
                                               {}))

    out = engine_figures(target, make, [[3, 9, 27], [5, 6, 7]], 16, 3, cfg.traits())
    assert out["engine_identical"] == 1.0 and out["engine_tau"] >= 1.0
    assert out["engine_speedup"] > 0


def test_serve_target_split_on_cuda(tiny_pair):
    import asyncio

    from serve_apps.target import TargetDeployment, _Starts, _Verifies
    from speclab.decoding.rules import RuleSpec

    dep = TargetDeployment(tiny_pair["target"], device="cuda", batch_wait_ms=0.0)
    row = {"rid": "r0", "prompt_ids": [3, 9, 27], "sampling": {"temperature": 0.0},
           "rule": RuleSpec("greedy").to_dict(), "seed": 0}

    async def one_batch():
        await dep._run([_Starts("src", [row], 0, False)])
        return (await dep._run([_Verifies("src", [("r0", None)])]))[0][0]

    reply = asyncio.run(one_batch())
    assert reply["target_model_s"] > 0 and reply["target_rule_s"] >= 0

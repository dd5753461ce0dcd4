"""The engine's own figures for a drafter under training (logged next to the loss).

A training task that can decode with its current model (an EAGLE drafter, Medusa heads)
calls :func:`engine_figures` at every report: greedy decoding of a few held-out prompts
with the engine, timed with the same paired protocol as ``bench`` and ``evaluate``
(:mod:`speclab.paired_timing`): per prompt, plain decoding and speculative decoding one
right after the other (plain first in even passes, speculative first in odd ones), over
``passes`` passes; ``engine_speedup`` is the median paired ratio, with its 95% interval
(``engine_speedup_lo`` / ``_hi``), the ratio of totals (``engine_speedup_totals``) and
``engine_noisy``. One short untimed pass of both (:data:`WARMUP_TOKENS` tokens of the
first prompt) runs first, so lazy initialisation (CUDA kernels and allocator pools, a
drafter's first shapes) lands in no timed figure; every clock read waits for the device
(:func:`speclab.timing.now`). tau and acceptance come from the first pass.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from speclab.decoding.drafting import Drafter, DraftTraits
from speclab.decoding.loop import accept_at_least, autoregressive_generate, generate_tokens
from speclab.decoding.rules import resolve_rule
from speclab.decoding.runner import ModelRunner
from speclab.decoding.sampling import SamplingParams
from speclab.paired_timing import TIMING_PASSES, Pair, normalize_ar, speedup_figures
from speclab.timing import now

#: new tokens of the untimed warm-up pass (plain, then speculative) before the timed ones
WARMUP_TOKENS = 4

#: the traits of the drafters trained here (EAGLE, Medusa): they read the target's features
FEATURE_DRAFTER = DraftTraits(needs_features=True)


def engine_figures(target: torch.nn.Module, make_drafter: Callable[[], Drafter],
                   prompts: list[list[int]], max_new_tokens: int,
                   positions: int, traits: DraftTraits = FEATURE_DRAFTER,
                   passes: int = TIMING_PASSES) -> dict[str, float]:
    """Greedy decoding of ``prompts`` with a fresh ``make_drafter()`` per prompt, each
    paired with plain decoding of the same prompt over ``passes`` passes (module
    docstring): ``engine_tau`` (tokens per target call), ``engine_accept_at_<k>``
    (fraction of rounds accepting at least ``k`` draft tokens, ``k = 1..positions``),
    ``engine_speedup`` (the median over pairs of plain decoding's wall time per token over
    the drafter's), ``engine_speedup_lo`` / ``engine_speedup_hi`` (its 95% interval),
    ``engine_speedup_totals`` (the ratio of totals), ``engine_noisy`` (1.0 when the
    protocol flags the timings) and ``engine_identical`` (1.0 when every output equals
    plain decoding's, as greedy speculative decoding must). An untimed warm-up (both
    kinds, :data:`WARMUP_TOKENS` tokens of the first prompt) runs before anything is
    timed; it counts in no figure."""
    params = SamplingParams(0.0)
    rule = resolve_rule(None, None, params)
    runner = ModelRunner(target)
    device = runner.device
    if prompts:  # warm-up, untimed and uncounted
        autoregressive_generate(runner, prompts[0], min(WARMUP_TOKENS, max_new_tokens), params)
        generate_tokens(runner, make_drafter(), prompts[0], min(WARMUP_TOKENS, max_new_tokens),
                        params, rule, traits=traits)

    def plain(prompt: list[int]) -> tuple[list[int], None]:
        return autoregressive_generate(runner, prompt, max_new_tokens, params)[0], None

    def speculative(prompt: list[int]):
        out_ids, stats = generate_tokens(runner, make_drafter(), prompt, max_new_tokens,
                                         params, rule, traits=traits)
        return list(out_ids), stats

    lengths: list[int] = []
    all_stats = []  # the speculative runs' stats (first pass)
    pairs: list[Pair] = []
    same = True
    for k in range(passes):
        for i, prompt in enumerate(prompts):
            order = (plain, speculative) if k % 2 == 0 else (speculative, plain)
            t0 = now(device)
            first = order[0](prompt)
            t1 = now(device)
            second = order[1](prompt)
            t2 = now(device)
            (ar, _), (sd, stats) = (first, second) if k % 2 == 0 else (second, first)
            ar_s, sd_s = (t1 - t0, t2 - t1) if k % 2 == 0 else (t2 - t1, t1 - t0)
            pairs.append(Pair(i, k, ar_s, len(ar), sd_s, len(sd)))
            if k == 0:
                same = same and list(sd) == list(ar)
                lengths += stats.accepted_lengths
                all_stats.append(stats)
    runner.release()
    fig = speedup_figures(normalize_ar(pairs))
    nan = float("nan")
    out = {"engine_tau": sum(lengths) / max(len(lengths), 1),
           "engine_speedup": fig["speedup"] if pairs else 0.0,
           "engine_speedup_lo": fig["speedup_lo"] if pairs else nan,
           "engine_speedup_hi": fig["speedup_hi"] if pairs else nan,
           "engine_speedup_totals": fig["speedup_totals"] if pairs else nan,
           "engine_noisy": float(fig["noisy"]),
           "engine_identical": float(same)}
    for k, frac in enumerate(accept_at_least(all_stats, positions), start=1):
        out[f"engine_accept_at_{k}"] = frac
    return out

"""The engine's own figures for a drafter under training (logged next to the loss).

A training task that can decode with its current model (an EAGLE drafter, Medusa heads)
calls :func:`engine_figures` at every report: greedy decoding of a few held-out prompts
with the engine, plain decoding first, then speculative, each prompt timed one after
the other in this process. One short untimed pass of both (:data:`WARMUP_TOKENS` tokens
of the first prompt) runs first, so lazy initialisation (CUDA kernels and allocator
pools, a drafter's first shapes) lands in no timed figure; every clock read waits for
the device (:func:`speclab.timing.now`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from speclab.decoding.drafting import Drafter, DraftTraits
from speclab.timing import now

#: new tokens of the untimed warm-up pass (plain, then speculative) before the timed ones
WARMUP_TOKENS = 4

#: the traits of the drafters trained here (EAGLE, Medusa): they read the target's features
FEATURE_DRAFTER = DraftTraits(needs_features=True)


def engine_figures(target: torch.nn.Module, make_drafter: Callable[[], Drafter],
                   prompts: list[list[int]], max_new_tokens: int,
                   positions: int, traits: DraftTraits = FEATURE_DRAFTER) -> dict[str, float]:
    """Greedy decoding of ``prompts`` with a fresh ``make_drafter()`` per prompt:
    ``engine_tau`` (tokens per target call), ``engine_accept_at_<k>`` (fraction of rounds
    accepting at least ``k`` draft tokens, ``k = 1..positions``), ``engine_speedup``
    (plain decoding's wall time over the drafter's) and ``engine_identical`` (1.0 when
    every output equals plain decoding's, as greedy speculative decoding must). An
    untimed warm-up (both kinds, :data:`WARMUP_TOKENS` tokens of the first prompt) runs
    before anything is timed; it counts in no figure."""
    from speclab.decoding.loop import autoregressive_generate, generate_tokens
    from speclab.decoding.rules import resolve_rule
    from speclab.decoding.runner import ModelRunner
    from speclab.decoding.sampling import SamplingParams

    params = SamplingParams(0.0)
    rule = resolve_rule(None, None, params)
    runner = ModelRunner(target)
    device = runner.device
    if prompts:  # warm-up, untimed and uncounted
        autoregressive_generate(runner, prompts[0], min(WARMUP_TOKENS, max_new_tokens), params)
        generate_tokens(runner, make_drafter(), prompts[0], min(WARMUP_TOKENS, max_new_tokens),
                        params, rule, traits=traits)
    lengths: list[int] = []
    ar_s = sd_s = 0.0
    same = True
    for prompt in prompts:
        t0 = now(device)
        ar, _ = autoregressive_generate(runner, prompt, max_new_tokens, params)
        t1 = now(device)
        out_ids, stats = generate_tokens(runner, make_drafter(), prompt, max_new_tokens,
                                         params, rule, traits=traits)
        ar_s, sd_s = ar_s + t1 - t0, sd_s + now(device) - t1
        same = same and list(out_ids) == list(ar)
        lengths += stats.accepted_lengths
    runner.release()
    out = {"engine_tau": sum(lengths) / max(len(lengths), 1),
           "engine_speedup": ar_s / sd_s if sd_s else 0.0,
           "engine_identical": float(same)}
    for k in range(1, positions + 1):
        out[f"engine_accept_at_{k}"] = sum(n - 1 >= k for n in lengths) / max(len(lengths), 1)
    return out

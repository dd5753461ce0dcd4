"""How far a decoding method moves the output distribution (``speclab shift``).

A lossless rule (greedy, speculative sampling) leaves the target's distribution where it
is; a relaxed one (Medusa's typical acceptance, AASD's conditional verification) does
not. :func:`first_token_shift` measures it where it can be computed exactly: the FIRST
generated token. For each prompt the target's own next-token distribution ``p`` (with the
request's temperature / top-k / top-p) is exact; the method is run ``samples`` times
(seeds ``0..samples-1``, two tokens each so that a draft tree is verified) and its
empirical first-token distribution ``p_hat`` gives the total variation
``TV = 1/2 sum |p_hat - p|``. Plain sampling (``ar``) is measured the same way: its TV
is the sampling-noise floor for ``samples`` draws, which a lossless method matches.
"""

from __future__ import annotations

import torch

from speclab.api import Decoder
from speclab.config.method import MethodSpec
from speclab.decoding.sampling import SamplingParams, warp_probs


def target_first_token(dec: Decoder, prompt_ids: list[int], params: SamplingParams
                       ) -> torch.Tensor:
    """The target's exact distribution ``[V]`` of the token after ``prompt_ids``."""
    dec.target.reset()
    logits = dec.target.forward(torch.tensor(prompt_ids, dtype=torch.long))[-1]
    dec.target.reset()
    return warp_probs(logits.float(), params)


def empirical_first_token(dec: Decoder, prompt_ids: list[int], method: MethodSpec | str,
                          samples: int, params: SamplingParams, verify: str | None = None,
                          verify_params: dict | None = None) -> torch.Tensor:
    """The method's first-token frequencies ``[V]`` over ``samples`` seeded runs."""
    counts = torch.zeros(dec.target.vocab_size)
    for seed in range(samples):
        res = dec.generate(prompt_ids=prompt_ids, method=method, max_new_tokens=2,
                           temperature=params.temperature, sample_top_k=params.top_k,
                           top_p=params.top_p, verify=verify, verify_params=verify_params,
                           seed=seed)
        counts[res.token_ids[0]] += 1
    return counts / samples


def total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    """``1/2 sum |p - q|`` of two distributions ``[V]``."""
    return 0.5 * float((p - q).abs().sum())


def first_token_shift(dec: Decoder, prompts: list[list[int]], method: MethodSpec,
                      samples: int, params: SamplingParams, verify: str | None = None,
                      verify_params: dict | None = None) -> list[dict]:
    """One row per prompt: ``tv_method`` (the method's first-token TV to the target's
    exact distribution), ``tv_ar`` (plain sampling's, the noise floor) and the
    probability mass the method and the target put on the target's most likely token."""
    if samples < 1:
        raise ValueError(f"samples: must be >= 1, got {samples}")
    if params.greedy:
        raise ValueError("temperature: the first-token distribution is a point mass at "
                         "temperature 0; give a temperature > 0")
    rows = []
    for i, ids in enumerate(prompts):
        p = target_first_token(dec, ids, params)
        got = empirical_first_token(dec, ids, method, samples, params, verify, verify_params)
        ar = empirical_first_token(dec, ids, "ar", samples, params)
        top = int(p.argmax())
        rows.append({"prompt": i, "tv_method": total_variation(got, p),
                     "tv_ar": total_variation(ar, p), "p_top_target": float(p[top]),
                     "p_top_method": float(got[top])})
    return rows

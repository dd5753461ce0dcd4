"""Temperature > 0: speculative sampling is lossless end to end.

On an 8-token vocabulary, the joint distribution of the first two new tokens from
chain / tree SD with sampling verification must match direct sampling from the target
(computed exactly from the model). Tolerance: a chi-square goodness-of-fit test over
3000 samples (cells with expected count < 5 pooled) must not reject at p = 0.001; with
fixed seeds the outcome is deterministic. A biased rule (e.g. accepting every draft)
fails it (p < 1e-4) (see ``test_chi_square_detects_a_biased_sampler``).
"""

import pytest
import torch
from scipy.stats import chisquare

from speclab.api import Decoder
from speclab.decoding.sampling import SamplingParams, warp_probs

N = 3000
PROMPT = [1, 4, 2]


def exact_two_token_dist(dec: Decoder, params: SamplingParams) -> dict:
    model = dec.target.model
    with torch.no_grad():
        first = warp_probs(model(torch.tensor([PROMPT])).logits[0, -1], params)
        out = {}
        for a in range(8):
            if first[a] == 0:
                continue
            second = warp_probs(model(torch.tensor([PROMPT + [a]])).logits[0, -1], params)
            for b in range(8):
                out[(a, b)] = float(first[a] * second[b])
    return out


def chi_square_p(counts: dict, exact: dict, n: int) -> float:
    """p-value of observed ``counts`` against ``exact`` probabilities (small cells pooled)."""
    assert not any(k not in exact for k in counts), "emitted a pair of probability 0"
    big = [k for k in exact if exact[k] * n >= 5]
    obs = [counts.get(k, 0) for k in big]
    exp = [exact[k] * n for k in big]
    rest_obs, rest_exp = n - sum(obs), n - sum(exp)
    if rest_obs or rest_exp != 0:  # the pooled small cells (0/0 when there are none)
        obs.append(rest_obs)
        exp.append(rest_exp)
    return float(chisquare(obs, exp).pvalue)


def test_chi_square_detects_a_biased_sampler(micro_pair):
    dec = Decoder.from_pretrained(micro_pair["target"], micro_pair["draft"])
    exact = exact_two_token_dist(dec, SamplingParams(1.0))
    q = exact_two_token_dist(Decoder.from_pretrained(micro_pair["draft"]), SamplingParams(1.0))
    keys = list(q)
    g = torch.Generator().manual_seed(0)
    draws = torch.multinomial(torch.tensor([q[k] for k in keys]), N, True, generator=g)
    counts = {}
    for i in draws.tolist():  # sampling from the DRAFT instead of the target
        counts[keys[i]] = counts.get(keys[i], 0) + 1
    assert chi_square_p(counts, exact, N) < 1e-4


#: (method, knobs, temperature, top_p): chains, a tree and SALF, with top-p and T < 1
CASES = [
    ("chain", {"gamma": 2}, 1.0, 1.0),
    ("tree", {"tree_top_k": 3, "depth": 2, "nodes": 6}, 1.0, 1.0),
    ("chain", {"gamma": 3}, 1.0, 0.8),
    ("salf", {"nodes": 6, "batch": 2, "salf_threshold": 0.2}, 0.8, 0.9),
    ("salf", {"nodes": 6, "batch": 2, "salf_threshold": 0.2}, 1.0, 1.0),
]


def _check(results, exact: dict) -> None:
    counts = {}
    for r in results:
        counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
    assert sum(r.stats.accepted_tokens for r in results) > N // 4  # drafts were accepted
    assert chi_square_p(counts, exact, N) > 1e-3


@pytest.mark.slow
def test_first_two_tokens_match_target_distribution(micro_pair):
    """The single-sequence driver (one generate call per seed); every case of
    :data:`CASES` runs through the batched driver below (the same round loop, ~20x
    cheaper per sample)."""
    method, hp, temperature, top_p = CASES[0]
    dec = Decoder.from_pretrained(micro_pair["target"], micro_pair["draft"])
    exact = exact_two_token_dist(dec, SamplingParams(temperature, 0, top_p))
    assert len(exact) >= 20  # the test only means something if many outcomes are likely
    _check([dec.generate(prompt_ids=PROMPT, method=method, max_new_tokens=2,
                         temperature=temperature, top_p=top_p, seed=seed, **hp)
            for seed in range(N)], exact)


@pytest.mark.parametrize("method,hp,temperature,top_p", CASES)
def test_batched_rows_match_target_distribution(micro_pair, method, hp, temperature, top_p):
    """The batched engine: N rows of the same prompt (seeds 0..N-1), 64 at a time."""
    dec = Decoder.from_pretrained(micro_pair["target"], micro_pair["draft"])
    exact = exact_two_token_dist(dec, SamplingParams(temperature, 0, top_p))
    assert len(exact) >= 20
    _check(dec.generate(prompts=[PROMPT] * N, method=method, max_new_tokens=2,
                        temperature=temperature, top_p=top_p, batch_size=64, **hp), exact)

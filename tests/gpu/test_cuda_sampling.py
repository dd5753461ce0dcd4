"""Speculative sampling stays lossless on CUDA (skipped without a GPU): the chi-square
check of ``tests/unit/test_engine_sampling.py`` with the models on the GPU, for every
tree-building method, single row and batched, and the sync counts of
``tests/unit/test_host_syncs.py`` with real device reads."""

import pytest
import torch

from speclab.api import Decoder
from speclab.decoding import host
from speclab.decoding.sampling import SamplingParams
from tests.unit.test_engine_sampling import CASES, PROMPT, N, _check, exact_two_token_dist

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("method,hp,temperature,top_p", CASES)
def test_cuda_batched_rows_match_target_distribution(micro_pair, method, hp, temperature,
                                                     top_p):
    dec = Decoder.from_pretrained(micro_pair["target"], micro_pair["draft"], device="cuda")
    exact = exact_two_token_dist(Decoder.from_pretrained(micro_pair["target"]),
                                 SamplingParams(temperature, 0, top_p))
    _check(dec.generate(prompts=[PROMPT] * N, method=method, max_new_tokens=2,
                        temperature=temperature, top_p=top_p, batch_size=256, **hp), exact)


def test_cuda_single_row_matches_target_distribution(micro_pair):
    method, hp, temperature, top_p = CASES[1]  # the tree
    dec = Decoder.from_pretrained(micro_pair["target"], micro_pair["draft"], device="cuda")
    exact = exact_two_token_dist(Decoder.from_pretrained(micro_pair["target"]),
                                 SamplingParams(temperature, 0, top_p))
    _check([dec.generate(prompt_ids=PROMPT, method=method, max_new_tokens=2,
                         temperature=temperature, top_p=top_p, seed=seed, **hp)
            for seed in range(N)], exact)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_cuda_waits_once_per_forward(tiny_pair, temperature):
    """Batched tree drafting and verification on CUDA: the waits through
    ``speclab.decoding.host`` stay at one per model forward for 1 and 16 rows."""
    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"], device="cuda")
    for rows in (1, 16):
        syncs0 = host.SYNCS.syncs
        res = dec.generate(prompts=[[1 + r, 2, 3] for r in range(rows)], method="tree",
                           tree_top_k=4, depth=3, nodes=12, max_new_tokens=16,
                           temperature=temperature)
        b = dec.last_batch
        assert host.SYNCS.syncs - syncs0 <= b.target_forwards + b.draft_forwards + 2
        assert all(len(r.token_ids) == 16 for r in res)

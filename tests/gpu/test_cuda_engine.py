"""The engine on CUDA: same greedy output as on CPU (skipped without a GPU)."""

import pytest
import torch

from speclab.api import Decoder

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("method,hp", [("chain", {"gamma": 4}), ("salf", {"salf_threshold": 0.2}),
                                       ("tree", {"tree_top_k": 3})])
def test_cuda_matches_cpu_greedy(tiny_pair, method, hp):
    cpu = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"], device="cpu")
    gpu = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"], device="cuda")
    assert gpu.target.device.type == "cuda"
    for ids in ([1, 2, 3], [7, 9, 11, 13, 2], [40]):
        want = cpu.generate(prompt_ids=ids, method="ar", max_new_tokens=24).token_ids
        got = gpu.generate(prompt_ids=ids, method=method, max_new_tokens=24, **hp)
        assert got.token_ids == want
        assert got.stats.target_calls < 24


@pytest.mark.parametrize("compile", [False, True])
def test_cuda_batched_rows_equal_rows_alone(tiny_pair, compile):
    """The batched engine on CUDA (and its static, compiled fast path): every row equals
    the prompt decoded alone."""
    one = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"], device="cuda")
    batched = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"], device="cuda",
                                      compile=compile)
    prompts = [[1, 2, 3], [7, 9, 11, 13, 2], [40], [5, 5]]
    for method, hp in [("ar", {}), ("chain", {"gamma": 3}), ("salf", {"nodes": 8, "batch": 2})]:
        alone = [one.generate(prompt_ids=p, method=method, max_new_tokens=24, **hp).token_ids
                 for p in prompts]
        res = batched.generate(prompts=prompts, method=method, max_new_tokens=24, batch_size=3,
                               **hp)
        assert [r.token_ids for r in res] == alone, method

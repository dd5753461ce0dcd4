"""What broke or misled on a first CUDA run (skipped without a GPU): sampling with a
row's CPU generator over CUDA probabilities, a tree's CPU draft distribution against
CUDA target probabilities, feature drafters loaded on the CPU, and prefill memory."""

import pytest
import torch

from speclab.api import Decoder

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

METHODS = [("ar", {}), ("chain", {"gamma": 3}), ("tree", {"tree_top_k": 2, "nodes": 8}),
           ("salf", {"nodes": 8, "batch": 2})]


@pytest.mark.parametrize("method,hp", METHODS)
def test_sampling_on_cuda_runs_and_a_seed_reproduces_it(tiny_pair, method, hp):
    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"], device="cuda")
    kw = {"method": method, "max_new_tokens": 24, "temperature": 0.8, "top_p": 0.95, **hp}
    a = dec.generate(prompt_ids=[1, 2, 3], seed=5, **kw)
    b = dec.generate(prompt_ids=[1, 2, 3], seed=5, **kw)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 24
    rows = dec.generate(prompts=[[1, 2, 3], [7, 9, 11], [40]], seed=5, **kw)
    assert [len(r.token_ids) for r in rows] == [24, 24, 24]


def test_feature_drafters_load_on_the_targets_device_and_dtype(tiny_pair, tmp_path):
    from speclab.models.eagle import EagleModel, save_eagle
    from speclab.models.loading import load_model

    folder = str(save_eagle(EagleModel.from_target(load_model(tiny_pair["target"])),
                            tmp_path / "e"))
    dec = Decoder.from_pretrained(tiny_pair["target"], device="cuda", dtype="bfloat16")
    ar = dec.generate(prompt_ids=[1, 2, 3], method="ar", max_new_tokens=16)
    res = dec.generate(prompt_ids=[1, 2, 3], method="eagle", eagle_model=folder,
                       max_new_tokens=16)
    drafter = dec._resources[("eagle", folder)]
    param = next(drafter.parameters())
    assert param.device.type == "cuda" and param.dtype == torch.bfloat16
    assert len(res.token_ids) == len(ar.token_ids)


def test_a_long_prompts_prefill_allocates_no_prompt_logits(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=65536, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    dec = Decoder.from_pretrained(str(tmp_path / "m"), device="cuda")
    peaks = []
    for n in (3, 2048):
        torch.cuda.reset_peak_memory_stats()
        dec.generate(prompt_ids=[(7 * i) % 60000 + 3 for i in range(n)], method="ar",
                     max_new_tokens=4)
        peaks.append(torch.cuda.max_memory_allocated())
    assert peaks[1] - peaks[0] < 100 * 2 ** 20, peaks  # [2047, 65536] float32 is 537 MB

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
    from speclab.families.eagle.model import EagleModel, save_eagle
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
    # batched EAGLE (every row's drafter step in one forward) on CUDA: a batch's rows
    # decode as they do alone (float32, where batching cannot move a near tie)
    dec32 = Decoder.from_pretrained(tiny_pair["target"], device="cuda")
    prompts = [[1, 2, 3], [7], [5, 6, 7, 8, 9]]
    kw = {"method": "eagle", "eagle_model": folder, "max_new_tokens": 16}
    alone = [dec32.generate(prompt_ids=q, **kw).token_ids for q in prompts]
    assert [r.token_ids for r in dec32.generate(prompts=prompts, batch_size=3, **kw)] == alone


def test_a_long_prompts_prefill_allocates_no_prompt_logits(tmp_path):
    """A 2048-token prompt's prefill computes the last position's logits only: its peak
    stays far below the ``[2047, 65536]`` float32 logits (537 MB). What it does hold is
    attention workspace: first run on an H200 (torch 2.11) with 2 KV heads for 4 query
    heads, float32 SDPA fell back to the math kernel and its ``[4, 2047, 2047]`` scores
    added 172 MB, over the first version's 100 MB bound; without grouped KV heads the
    memory-efficient kernel runs. The bound is half the logits' size, so the defect this
    pins (prompt logits) fails it whatever the attention kernel."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=65536, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=4096)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    dec = Decoder.from_pretrained(str(tmp_path / "m"), device="cuda")
    peaks = []
    for n in (3, 2048):
        torch.cuda.reset_peak_memory_stats()
        dec.generate(prompt_ids=[(7 * i) % 60000 + 3 for i in range(n)], method="ar",
                     max_new_tokens=4)
        peaks.append(torch.cuda.max_memory_allocated())
    logits_bytes = 2047 * 65536 * 4
    assert peaks[1] - peaks[0] < logits_bytes / 2, peaks


def test_medusa_heads_and_acceptance_heads_run_on_the_targets_device(tiny_pair, tmp_path):
    """Medusa heads load on the target's device and dtype; SpecDec++'s acceptance head on
    the draft's device (it casts the features to its own dtype); both decode greedily
    exactly like plain decoding."""
    from speclab.decoding.acceptance_head import AcceptanceHead
    from speclab.families.medusa.model import MedusaHeads, save_medusa
    from speclab.models.loading import load_model

    target = load_model(tiny_pair["target"])
    folder = str(save_medusa(MedusaHeads.from_target(target, tiny_pair["target"], 3),
                             tmp_path / "m"))
    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"], device="cuda",
                                  dtype="bfloat16")
    want = dec.generate(prompt_ids=[1, 2, 3], method="ar", max_new_tokens=16).token_ids
    # uncalibrated heads (no tree.json): the sparse default tree is refused for them
    got = dec.generate(prompt_ids=[1, 2, 3], method="medusa", medusa_model=folder,
                       tree="cartesian", max_new_tokens=16)
    heads = dec._resources[("medusa", folder)]
    param = next(heads.parameters())
    assert param.device.type == "cuda" and param.dtype == torch.bfloat16
    assert got.token_ids == want
    head = AcceptanceHead(int(dec.draft.model.config.hidden_size), 1)
    got = dec.generate(prompt_ids=[1, 2, 3], method="specdecpp", head=head,
                       stop_threshold=0.5, max_new_tokens=16)
    assert next(head.parameters()).device.type == "cuda" and got.token_ids == want


def test_bfloat16_on_cuda_differs_from_plain_decoding_only_at_near_ties(tiny_pair):
    """The model-families divergence report on the GPU: `speclab check-model`'s comparison
    in bfloat16: every method's output equals plain decoding's (and plain decoding HF
    generate's) up to near ties."""
    from speclab.compat import check_model

    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"], device="cuda",
                                  dtype="bfloat16")
    prompts = [[1 + i, 7, 3 + 2 * i, 9] for i in range(8)]
    report = check_model(dec, prompts, 32)
    print("\n".join(f"{r['method']:>7} {r['mode']:>7}: identical {r['identical']} near ties "
                    f"{r['near_ties']} differing {r['differing']} tau {r['tau']:.2f}"
                    for r in report["rows"]))
    assert not report["problems"], report["problems"]

"""Outputs against plain decoding (``speclab.agreement``, the bench's ``identical_to_ar``
cell): identical, a near tie (low precision, plain decoding's token within a few ulps
of the method's) or a failure, on tiny real LLaMAs."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from speclab.agreement import (
    agreement_cell,
    choice_margin,
    compare_outputs,
    first_difference,
    mark_agreement,
    merge_agreements,
)
from speclab.bench import BATCH_COLUMNS
from speclab.evaluation import COLUMNS

PROMPTS = [[3, 17, 41, 5], [60, 22, 9], [33, 48, 1, 27, 14]]


def _llama(dtype: torch.dtype, flat: bool = False) -> LlamaForCausalLM:
    """A random 2-layer LLaMA with peaked logits; ``flat``: its LM head zeroed, so every
    logit is 0 and every token ties with every other."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(0.0 if flat else 8.0)
    return model.to(dtype)


def _greedy(model, prompt: list[int], n: int = 4) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_a_tie_decided_the_other_way_is_a_near_tie_only_below_float32():
    for dtype, tie in ((torch.bfloat16, True), (torch.float32, False)):
        model = _llama(dtype, flat=True)
        want = [_greedy(model, p) for p in PROMPTS]
        got = [list(w) for w in want]
        got[1][2] = (want[1][2] + 1) % 64  # the other of two exactly tied tokens
        row = compare_outputs(model, PROMPTS, got, want)
        assert (row["identical"], row["near_ties"], row["differing"]) == \
            ((2, 1, 0) if tie else (2, 0, 1))
        assert row["first_differences"] == [{"position": 2, "margin": 0.0,
                                             "near_tie": tie}]


def test_a_token_far_below_plain_decodings_is_a_failure_in_bfloat16():
    model = _llama(torch.bfloat16)
    prompt = PROMPTS[0]
    want = _greedy(model, prompt)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    worst = int(logits.argmin())  # judged by its own margin, not the top-2 one
    margin, tol = choice_margin(model, prompt, want[0], worst)
    assert margin == float(logits.float().max() - logits.float().min()) and margin > tol
    row = compare_outputs(model, [prompt], [[worst] + want[1:]], [want])
    assert (row["near_ties"], row["differing"]) == (0, 1)
    assert not row["first_differences"][0]["near_tie"]
    # an output cut short where plain decoding went on: judged by the top-2 margin
    short = compare_outputs(model, [prompt], [want[:2]], [want])
    assert short["first_differences"][0]["position"] == 2
    # plain decoding ended and the method went on: always a failure
    longer = compare_outputs(model, [prompt], [want + [5]], [want])
    assert longer["differing"] == 1


def test_bench_rows_say_how_their_outputs_differ():
    model = _llama(torch.bfloat16, flat=True)
    want = [_greedy(model, p) for p in PROMPTS]
    got = [list(w) for w in want]
    got[0][0] = (want[0][0] + 3) % 64
    same = mark_agreement(model, PROMPTS, {"identical_to_ar": True}, want, want)
    assert "near_ties" not in same
    row = mark_agreement(model, PROMPTS, {"identical_to_ar": False}, got, want)
    cell = agreement_cell("identical_to_ar")
    assert cell(same) == "True" and cell(row) == "ties 1/3"
    assert cell({**row, "near_ties": 0, "differing": 1}) == "False (1/3 differ)"
    assert cell({"identical_to_ar": False}) == "False" and cell({}) == "-"
    shown = dict(COLUMNS)  # every table shows it so: bench's, evaluate's
    assert shown["identical_to_ar"](row) == "ties 1/3"
    alone = mark_agreement(model, PROMPTS, {"identical_to_alone": False}, got, want,
                           "identical_to_alone")
    assert dict(BATCH_COLUMNS)["identical_to_alone"](alone) == "ties 1/3"


def test_agreements_of_shards_merge():
    a = {"identical": 2, "near_ties": 1, "differing": 0,
         "first_differences": [{"position": 3, "margin": 0.0, "near_tie": True}]}
    b = {"identical": 0, "near_ties": 0, "differing": 1,
         "first_differences": [{"position": 0, "margin": 2.5, "near_tie": False}]}
    both = merge_agreements([a, b])
    assert (both["identical"], both["near_ties"], both["differing"]) == (2, 1, 1)
    assert both["first_differences"] == a["first_differences"] + b["first_differences"]
    assert agreement_cell("identical_to_ar")({"identical_to_ar": False, **both}) == \
        "False (1/4 differ)"


def test_each_evaluation_actor_classifies_its_shard():
    """What an evaluation actor adds to its results (the evaluate job's rows then read
    ``ties k/n`` as bench's do): per method, its outputs against the first method's AR
    outputs (no forward where they are identical)."""
    from speclab.evaluation import Totals
    from speclab.pipelines.actor_eval import shard_agreement

    model = _llama(torch.bfloat16, flat=True)
    want = [_greedy(model, p) for p in PROMPTS]
    got = [list(w) for w in want]
    got[1][2] = (want[1][2] + 5) % 64
    results = {"chain": {"ar": Totals(outputs=want), "totals": Totals(outputs=got)},
               "tree": {"ar": Totals(outputs=want), "totals": Totals(outputs=want)}}
    shard_agreement(model, PROMPTS, results)
    assert results["tree"]["agreement"] == {"identical": 3, "near_ties": 0, "differing": 0,
                                            "first_differences": []}
    chain = results["chain"]["agreement"]
    assert (chain["identical"], chain["near_ties"], chain["differing"]) == (2, 1, 0)
    assert chain["first_differences"][0]["position"] == 2

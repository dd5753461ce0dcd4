"""Distillation signals from the target and their collation into training batches."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from speclab.decoding.runner import ModelRunner
from speclab.models.loading import load_model
from speclab.train.distill_batches import batch_loss, collate_kd, collate_seq, collate_trees
from speclab.train.distill_data import kd_example, seq_examples, tree_example


@pytest.fixture(scope="module")
def target(tiny_pair):
    return ModelRunner(load_model(tiny_pair["target"]))


def test_kd_example_matches_target_distribution(target, tiny_pair):
    window = [3, 9, 27, 17, 51, 2, 8]
    row = kd_example(target, window, k=5)
    assert len(row["topk_ids"]) == 6 and len(row["topk_ids"][0]) == 5
    hf = AutoModelForCausalLM.from_pretrained(tiny_pair["target"])
    with torch.no_grad():
        p = hf(torch.tensor([window[:-1]])).logits[0].softmax(-1)
    assert row["topk_ids"][2][0] == int(p[2].argmax())
    # the target's own probabilities, not renormalised over the kept entries (HASS's p)
    torch.testing.assert_close(torch.tensor(row["topk_probs"][4]),
                               p[4].topk(5).values, atol=1e-5, rtol=1e-4)
    assert sum(row["topk_probs"][4]) < 1.0
    batch = collate_kd([row, row])
    assert batch["inputs"].shape == (2, 6) and batch["topk_probs"].shape == (2, 6, 5)


def test_seq_examples_are_target_greedy(target):
    from speclab.decoding.loop import autoregressive_generate
    from speclab.decoding.sampling import SamplingParams

    prompts = [[1, 2, 3], [4, 5], [9], [7, 7, 7, 7]]
    rows = seq_examples(target, prompts, 6, eos=None, batch=3)  # batched, rows join
    for p, row in zip(prompts, rows):
        out, _ = autoregressive_generate(target, p, 6, SamplingParams(0.0))
        assert row["tokens"] == p + out and row["loss_from"] == len(p)
    eos = rows[0]["tokens"][4]
    assert seq_examples(target, [[1, 2, 3]], 6, eos=eos)[0]["tokens"] == rows[0]["tokens"][:5]
    row = rows[0]
    b = collate_seq([row, seq_examples(target, [[4, 5]], 3, eos=None)[0]])
    assert b["mask"][0].tolist() == [0, 0, 1, 1, 1, 1, 1, 1]
    assert b["mask"][1].tolist() == [0, 1, 1, 1, 0, 0, 0, 0]


def test_tree_batch_forward_equals_per_path_decoding(target, tiny_pair):
    rows = [tree_example(target, [5, 6, 7, 8], top_k=3, depth=3, nodes=7, k=4),
            tree_example(target, [9, 10, 11, 12, 13, 14], top_k=2, depth=2, nodes=3, k=4)]
    assert len(rows[0]["tree_tokens"]) == 8 and len(rows[1]["tree_tokens"]) == 4
    batch = collate_trees(rows)
    model = AutoModelForCausalLM.from_pretrained(tiny_pair["target"]).eval()
    with torch.no_grad():
        logits = model(input_ids=batch["inputs"], position_ids=batch["positions"],
                       attention_mask=batch["attn"]).logits
    for b, row in enumerate(rows):
        parents = row["tree_parents"]
        for node in range(len(parents)):
            path, n = [], node
            while n >= 0:
                path.append(row["tree_tokens"][n])
                n = parents[n]
            seq = row["tokens"][:-1] + path[::-1]
            with torch.no_grad():
                want = model(torch.tensor([seq])).logits[0, -1]
            got = logits[b, batch["node_index"][b, node]]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            # the stored target distribution is the target's at that node
            assert row["topk_ids"][node][0] == int(want.argmax())


def test_talf_batch_loss_is_finite_and_trains(tiny_pair, target):
    rows = [tree_example(target, [5, 6, 7, 8], top_k=2, depth=3, nodes=6, k=4)] * 2
    batch = collate_trees(rows)
    model = AutoModelForCausalLM.from_pretrained(tiny_pair["close"])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = None
    for _ in range(10):
        loss = batch_loss(model, "talf", batch)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert torch.isfinite(loss) and loss.item() < first


def test_generation_progress_line_gives_the_rate_and_eta():
    from speclab.pipelines.signals import progress_line

    assert progress_line(2, 8, 128, 64.0) == ("2/8 shards (128 examples) in 64 s, 2.0 "
                                              "examples/s, ETA 192 s")
    assert progress_line(8, 8, 512, 256.0).endswith("ETA 0 s")

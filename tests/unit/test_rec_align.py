"""AtSpeed drafter alignment data (target top-K beams + distributions) and its losses."""

import pytest
import torch

from speclab.data import recsys
from speclab.data.rec_dataset import RecExample, RecMeta
from speclab.decoding.beam import constrained_beam_search, mixture_beam_search
from speclab.decoding.runner import ModelRunner
from speclab.families.atspeed.training import (
    REC_LOSSES,
    alignment_example,
    collate_align,
    rec_align_loss,
)
from speclab.models.loading import load_model
from speclab.models.tiny import build_tiny_llama


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("align")
    feats = recsys.item_features(recsys.SyntheticSpec(items=30, seed=3))
    codes = recsys.semantic_ids(feats, levels=3, codebook=4)
    meta = RecMeta(list(range(30)), [list(c) for c in codes], 3, 4, history=3)
    t = build_tiny_llama(root / "t", seed=1, vocab_size=meta.vocab_size, hidden_size=32)
    d = build_tiny_llama(root / "d", seed=2, vocab_size=meta.vocab_size, hidden_size=16,
                         num_layers=1)
    return meta, ModelRunner(load_model(str(t))), str(d)


def test_alignment_example_holds_the_target_distributions(setup):
    meta, target, _ = setup
    trie = meta.trie()
    prompt = meta.prompt([3, 7, 11])
    row = alignment_example(target, trie, prompt, k=4)
    beams, _ = constrained_beam_search(target, prompt, trie, 4)
    assert row["beams"] == [list(b[0]) for b in beams]
    for j, beam in enumerate(row["beams"]):
        for t in range(3):
            target.reset()
            want = target.forward(torch.tensor(prompt + beam[:t]))[-1].log_softmax(-1)
            torch.testing.assert_close(row["target_logp"][j, t].float(), want,
                                       atol=2e-2, rtol=1e-2)  # stored as float16
            assert set(row["valid"][j, t].nonzero().flatten().tolist()) == set(
                trie.allowed(tuple(beam[:t])))
    last = row["beams"][-1]
    # log p(y_K): the K-th beam's token under the target (stored logp is float16)
    assert float(row["log_p_k"][1]) == pytest.approx(
        float(row["target_logp"][-1, 1, last[1]]), abs=2e-3)


def _log_p(target, prompt, seq):
    out = []
    for t in range(len(seq)):
        target.reset()
        out.append(float(target.forward(torch.tensor(prompt + list(seq[:t])))[-1]
                         .log_softmax(-1)[seq[t]]))
    return out


def test_mixture_alignment_rows_follow_the_mixture_beams(setup):
    meta, target, draft_dir = setup
    trie, draft = meta.trie(), ModelRunner(load_model(draft_dir))
    prompt = meta.prompt([2, 5])
    row = alignment_example(target, trie, prompt, 4, draft, 0.5)
    assert row["beams"] == [list(b[0]) for b in
                            mixture_beam_search(target, draft, prompt, trie, 4, 0.5)]
    assert all(tuple(b) in trie for b in row["beams"])
    target.reset()  # the stored distributions are still the TARGET's
    want = target.forward(torch.tensor(prompt))[-1].log_softmax(-1)
    torch.testing.assert_close(row["target_logp"][0, 0].float(), want, atol=2e-2, rtol=1e-2)


def test_mixture_rows_take_log_p_yk_along_the_targets_kth_beam(setup):
    # issue 14 bug 6: p(y_K) is defined under the TARGET (eq. 3), also for lambda < 1
    meta, target, draft_dir = setup
    trie, draft = meta.trie(), ModelRunner(load_model(draft_dir))
    checked = 0
    for hist in ([2, 5], [1, 9], [4, 8, 12], [7], [20, 3]):
        prompt = meta.prompt(hist)
        row = alignment_example(target, trie, prompt, 4, draft, 0.0)
        y_k = constrained_beam_search(target, prompt, trie, 4)[0][-1][0]
        got = row["log_p_k"].tolist()
        assert got == pytest.approx(_log_p(target, prompt, y_k), abs=1e-4)
        if list(y_k) != row["beams"][-1]:
            checked += 1  # the mixture's K-th beam is another sequence here
            assert got != pytest.approx(_log_p(target, prompt, row["beams"][-1]), abs=1e-4)
    assert checked > 0, "no prompt where the drafter's K-th beam differs from the target's"


@pytest.mark.parametrize("loss_name", ["atspeed_s", "atspeed_r"])
def test_alignment_keeps_k_per_position_in_mixed_batches(setup, loss_name):
    # issue 14 bug 1: an example whose positions have a single valid token must not shrink
    # the candidate count of the others: the batch loss is the mean of each example alone
    from transformers import AutoModelForCausalLM

    meta, target, draft_dir = setup
    examples = [RecExample(0, meta.prompt([1, 2]), 5), RecExample(0, meta.prompt([4]), 9)]
    rows = [alignment_example(target, meta.trie(), e.prompt, 3) for e in examples]
    one = rows[1]["valid"].clone()
    one[:] = False
    for j, beam in enumerate(rows[1]["beams"]):
        for t, tok in enumerate(beam):
            one[j, t, tok] = True  # only the beam's own token is valid
    rows[1] = {**rows[1], "valid": one}
    assert int(rows[0]["valid"].sum(-1).max()) >= 3
    model = AutoModelForCausalLM.from_pretrained(draft_dir)

    def loss(idx):
        batch = collate_align([rows[i] for i in idx], [examples[i] for i in idx], meta,
                              loss_name)
        return rec_align_loss(model, batch, loss_name, alpha=1.0, k=3).item()

    alone = [loss([0]), loss([1])]
    assert loss([0, 1]) == pytest.approx(sum(alone) / 2, rel=1e-5)
    assert alone[0] != 0.0
    if loss_name == "atspeed_r":
        assert alone[1] == 0.0  # one valid token: nothing to align


def test_alignment_sums_over_beams_and_averages_over_positions(setup):
    # eq. 4: sum over the K beams of the per-beam mean over the L positions
    from transformers import AutoModelForCausalLM

    from speclab import losses

    meta, target, draft_dir = setup
    ex = RecExample(0, meta.prompt([6, 7]), 2)
    row = alignment_example(target, meta.trie(), ex.prompt, 3)
    model = AutoModelForCausalLM.from_pretrained(draft_dir)
    batch = collate_align([row], [ex], meta, "atspeed_r")
    got = rec_align_loss(model, batch, "atspeed_r", alpha=1.0, k=3).item()
    b = batch["beams"]
    logits = model(input_ids=b["inputs"]).logits.gather(
        1, b["answer"][..., None].expand(-1, -1, meta.vocab_size))
    per_pos = losses.align_r(logits, b["target_logp"], b["valid"], 3)  # [3 beams, L]
    assert per_pos.shape == (3, 3)
    assert got == pytest.approx(float(per_pos.mean(-1).sum().detach()), rel=1e-5)


@pytest.mark.parametrize("loss_name", REC_LOSSES)
def test_every_rec_loss_trains_the_drafter(setup, loss_name):
    from transformers import AutoModelForCausalLM

    meta, target, draft_dir = setup
    trie = meta.trie()
    examples = [RecExample(0, meta.prompt(h), tgt) for h, tgt in
                [([1, 2], 5), ([4], 9), ([6, 7, 8], 2), ([3], 14)]]
    rows = [alignment_example(target, trie, e.prompt, 3) for e in examples]
    batch = collate_align(rows, examples, meta, loss_name)
    model = AutoModelForCausalLM.from_pretrained(draft_dir)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = None
    for _ in range(8):
        loss = rec_align_loss(model, batch, loss_name, alpha=0.7, k=3)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert torch.isfinite(loss) and loss.item() < first


def test_alpha_zero_reduces_atspeed_to_the_recommendation_loss(setup):
    from transformers import AutoModelForCausalLM

    meta, target, draft_dir = setup
    examples = [RecExample(0, meta.prompt([1, 2]), 5), RecExample(0, meta.prompt([4]), 9)]
    rows = [alignment_example(target, meta.trie(), e.prompt, 3) for e in examples]
    model = AutoModelForCausalLM.from_pretrained(draft_dir)
    sft = rec_align_loss(model, collate_align(rows, examples, meta, "sft"), "sft", 0.0, 3)
    for name in ("atspeed_s", "atspeed_r"):
        got = rec_align_loss(model, collate_align(rows, examples, meta, name), name, 0.0, 3)
        assert got.item() == pytest.approx(sft.item(), rel=1e-6)
    with pytest.raises(ValueError, match="unknown recommendation loss"):
        collate_align(rows, examples, meta, "talf")


def test_rec_align_task_batches_deterministically_and_trains(setup, tmp_path):
    import json
    from dataclasses import asdict

    from transformers import AutoModelForCausalLM

    from speclab.config.schema import TrainConfig
    from speclab.families.atspeed.task import RecAlignTaskConfig
    from speclab.train.tasks import TASKS

    meta, target, draft_dir = setup
    train = [RecExample(0, meta.prompt([i % 30, (i * 7) % 30]), (i * 3) % 30) for i in range(12)]
    meta.save(tmp_path)
    (tmp_path / "examples.json").write_text(json.dumps(
        {"train": [asdict(e) for e in train], "validation": [asdict(e) for e in train[:2]],
         "test": []}))
    rows = [alignment_example(target, meta.trie(), e.prompt, 3) for e in train[:8]]
    torch.save(rows, tmp_path / "align.pt")
    cfg = RecAlignTaskConfig(train=TrainConfig(batch_size=4), loss="atspeed_r",
                             align_alpha=0.6, align_k=3)
    task = TASKS["rec_align"](cfg, tmp_path, torch.device("cpu"))
    assert len(task.train) == 8  # only examples that have alignment rows
    a, b = task.batch(5, 1), task.batch(5, 1)
    assert torch.equal(a["beams"]["inputs"], b["beams"]["inputs"])  # same (step, rank)
    model = AutoModelForCausalLM.from_pretrained(draft_dir)
    loss = task.loss(model, a)
    loss.backward()
    assert torch.isfinite(loss) and task.tokens_in(a) > 0
    assert task.validate(model) > 0

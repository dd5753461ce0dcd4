"""Distillation losses on hand-made distributions with known values."""

import math

import pytest
import torch

from speclab import losses

V = 6


def logits_of(p: torch.Tensor) -> torch.Tensor:
    return torch.log(p.clamp_min(1e-30))


def dense_as_topk(p: torch.Tensor):
    probs, ids = torch.sort(p, dim=-1, descending=True)
    return ids, probs


def test_kl_of_identical_distributions_is_zero():
    p = torch.softmax(torch.randn(2, 3, V, generator=torch.Generator().manual_seed(0)), -1)
    ids, probs = dense_as_topk(p)
    mask = torch.ones(2, 3)
    assert losses.word_kd(logits_of(p), ids, probs, mask).item() == pytest.approx(0, abs=1e-6)
    assert losses.tvd_kd(logits_of(p), ids, probs, mask).item() == pytest.approx(0, abs=1e-6)


def test_tvd_of_disjoint_distributions_is_one():
    # p = [0.5, 0.5, 0, 0, 0, 0] as kept entries; q puts no mass on tokens 0 and 1
    q = torch.tensor([[[0, 0, 0.2, 0.3, 0.5, 0]]])
    ids, probs = torch.tensor([[[0, 1]]]), torch.tensor([[[0.5, 0.5]]])
    val = losses.tvd_kd(logits_of(q), ids, probs, torch.ones(1, 1)).item()
    assert val == pytest.approx(1.0, abs=1e-6)


def test_kl_known_value():
    # p = [0.5, 0.5, 0, 0, 0, 0] as kept entries
    q = torch.tensor([0.25, 0.25, 0.125, 0.125, 0.125, 0.125])
    ids, probs = torch.tensor([[[0, 1]]]), torch.tensor([[[0.5, 0.5]]])
    val = losses.word_kd(logits_of(q)[None, None], ids, probs, torch.ones(1, 1)).item()
    assert val == pytest.approx(math.log(2), abs=1e-6)  # sum 0.5 * log(0.5/0.25)


def test_hass_topk_and_masking_and_weights():
    q = torch.softmax(torch.randn(2, 2, V, generator=torch.Generator().manual_seed(1)), -1)
    ids = torch.tensor([[[3, 1]] * 2] * 2)
    probs = torch.tensor([[[0.7, 0.3]] * 2] * 2)
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    got = losses.hass_topk(logits_of(q), ids, probs, mask).item()
    want = [-(0.7 * q[b, t, 3].log() + 0.3 * q[b, t, 1].log()) for b, t in [(0, 0), (1, 0), (1, 1)]]
    assert got == pytest.approx(float(sum(want) / 3), rel=1e-5)
    top1 = losses.hass_topk(logits_of(q), ids, probs, mask, top_k=1).item()
    assert top1 == pytest.approx(float(sum(-0.7 * q[b, t, 3].log()
                                           for b, t in [(0, 0), (1, 0), (1, 1)]) / 3), rel=1e-5)
    w = losses.hass_topk(logits_of(q), ids, probs, mask, weights=torch.tensor([1.0, 0.0]))
    assert w.item() == pytest.approx(float(want[0]), rel=1e-5)


def test_talf_on_one_path_tree_equals_sequence_loss():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 5, V, generator=g)
    labels = torch.randint(0, V, (1, 5), generator=g)
    mask = torch.ones(1, 5)
    seq = losses.cross_entropy(logits, labels, mask)
    tree = losses.talf(logits, labels[..., None], torch.ones(1, 5, 1), mask)
    assert tree.item() == pytest.approx(seq.item(), rel=1e-6)


def test_unknown_loss_name():
    with pytest.raises(ValueError, match="loss: unknown loss 'nope'"):
        losses.get_loss("nope")


def test_hass_weighs_by_the_targets_own_probabilities():
    # stored entries are the target's probabilities (0.5, 0.2; 0.3 lies elsewhere): HASS
    # weighs log q by them as they are, the distribution losses renormalise them
    q = torch.tensor([0.4, 0.1, 0.2, 0.1, 0.1, 0.1])
    ids, raw = torch.tensor([[[0, 1]]]), torch.tensor([[[0.5, 0.2]]])
    mask = torch.ones(1, 1)
    got = losses.hass_topk(logits_of(q)[None, None], ids, raw, mask).item()
    assert got == pytest.approx(-(0.5 * math.log(0.4) + 0.2 * math.log(0.1)), rel=1e-6)
    top1 = losses.hass_topk(logits_of(q)[None, None], ids, raw, mask, top_k=1).item()
    assert top1 == pytest.approx(-0.5 * math.log(0.4), rel=1e-6)
    norm = raw / raw.sum(-1, keepdim=True)
    for fn in (losses.word_kd, losses.tvd_kd):
        assert fn(logits_of(q)[None, None], ids, raw, mask).item() == pytest.approx(
            fn(logits_of(q)[None, None], ids, norm, mask).item(), rel=1e-6)


def test_rec_loss_sums_positions_and_averages_examples():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, V, generator=g)
    labels = torch.randint(0, V, (2, 4), generator=g)
    mask = torch.tensor([[0.0, 1, 1, 1], [0, 0, 1, 1]])
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    want = ((ce[0, 1:].sum() + ce[1, 2:].sum()) / 2).item()  # eq. 37
    assert losses.rec_loss(logits, labels, mask).item() == pytest.approx(want, rel=1e-6)


def test_atspeed_s_known_value_and_zero_case():
    # one position, V = 6, tokens 0..3 valid; draft q puts 0.5/0.3 on tokens 1/2 (top-2 valid)
    q = torch.tensor([0.05, 0.5, 0.3, 0.05, 0.1, 0.0])
    p = torch.tensor([0.1, 0.2, 0.4, 0.1, 0.1, 0.1])
    valid = torch.tensor([True, True, True, True, False, False])[None, None]
    log_p_k = torch.tensor([[math.log(0.2)]])
    got = losses.align_s(logits_of(q)[None, None], logits_of(p)[None, None], valid,
                         log_p_k, k=2)
    want = 0.5 * (math.log(0.2) - math.log(0.2)) + 0.3 * (math.log(0.2) - math.log(0.4))
    assert got.shape == (1, 1) and got.item() == pytest.approx(want, rel=1e-5)
    # when every V_c token has the K-th sequence's probability, the loss is 0
    p_flat = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.1, 0.1])
    zero = losses.align_s(logits_of(q)[None, None], logits_of(p_flat)[None, None], valid,
                          log_p_k, k=2)
    assert zero.item() == pytest.approx(0.0, abs=1e-6)


def test_atspeed_r_known_values():
    valid = torch.tensor([True, True, True, False, False, False])[None, None]
    p = torch.tensor([0.4, 0.2, 0.1, 0.2, 0.05, 0.05])  # target top-2 valid: tokens 0, 1
    same = losses.align_r(logits_of(p)[None, None], logits_of(p)[None, None], valid, k=2)
    assert same.item() == pytest.approx(0.0, abs=1e-6)
    q = torch.tensor([0.1, 0.3, 0.3, 0.1, 0.1, 0.1])  # truncated: q' = (0.25, 0.75)
    got = losses.align_r(logits_of(q)[None, None], logits_of(p)[None, None], valid, k=2)
    assert got.item() == pytest.approx(0.5 * (abs(2 / 3 - 0.25) + abs(1 / 3 - 0.75)), rel=1e-5)


@pytest.mark.parametrize("fn", ["s", "r"])
def test_each_position_aligns_over_its_own_valid_tokens(fn):
    # issue 14 bug 1: positions with 1 valid token must not shrink k for the batch
    g = torch.Generator().manual_seed(4)
    v = 16
    logits = torch.randn(2, 3, v, generator=g)
    target = torch.randn(2, 3, v, generator=g).log_softmax(-1)
    log_p_k = torch.randn(2, 3, generator=g).clamp_max(0) - 1
    valid = torch.zeros(2, 3, v, dtype=torch.bool)
    valid[0, :, :10] = True  # 10 valid tokens everywhere in row 0
    valid[1, :, 5] = True  # a single valid token everywhere in row 1
    valid[1, 1, :10] = True  # ... except position 1

    def loss(rows, cols):
        sl = (slice(rows[0], rows[1]), slice(cols[0], cols[1]))
        if fn == "s":
            return losses.align_s(logits[sl], target[sl], valid[sl], log_p_k[sl], 4)
        return losses.align_r(logits[sl], target[sl], valid[sl], 4)

    batch = loss((0, 2), (0, 3))
    for r in range(2):
        for t in range(3):
            alone = loss((r, r + 1), (t, t + 1))
            assert batch[r, t].item() == pytest.approx(alone.item(), rel=1e-6, abs=1e-7)
    assert batch[0].abs().sum() > 0 and batch[1, 1].abs() > 0
    if fn == "r":  # one valid token: the truncated distributions coincide
        assert batch[1, 0].item() == 0.0 and batch[1, 2].item() == 0.0


def test_topk_kl_is_a_divergence_that_keeps_the_rest_of_the_mass():
    """0 for the teacher itself; unlike a renormalised top-k cross-entropy it is not
    lowered by moving the mass outside the top-k onto the kept tokens."""
    from speclab.losses import soft_ce, topk_kl

    torch.manual_seed(0)
    teacher = torch.randn(1, 3, 20)
    probs, ids = teacher.softmax(-1).topk(4, dim=-1)
    mask = torch.ones(1, 3)
    assert float(topk_kl(teacher, ids, probs, mask)) == pytest.approx(0.0, abs=1e-5)
    sharp = teacher.clone()
    sharp.scatter_add_(-1, ids, torch.full_like(probs, 5.0))  # all mass onto the top-4
    assert float(topk_kl(sharp, ids, probs, mask)) > 0.5
    assert float(soft_ce(sharp, ids, probs, mask)) < float(soft_ce(teacher, ids, probs, mask))

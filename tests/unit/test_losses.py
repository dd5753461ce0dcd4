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

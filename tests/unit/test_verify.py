"""Verification rules with hand-made logits and distributions."""

import math

import pytest
import torch

from speclab.decoding.rules import verify_greedy, verify_speculative, verify_typical_relaxed
from speclab.decoding.sampling import SamplingParams, warp_probs
from speclab.decoding.tree import DETERMINISTIC, SAMPLED, TokenTree


def onehot_logits(ids, vocab=6):
    out = torch.full((len(ids), vocab), -5.0)
    for i, t in enumerate(ids):
        out[i, t] = 5.0
    return out


def test_greedy_accepts_matching_prefix_then_corrects():
    tree = TokenTree.chain(0, [1, 2, 3])
    # target argmax at nodes: root->1 (match), node1->2 (match), node2->4 (mismatch 3)
    verdict = verify_greedy(tree, onehot_logits([1, 2, 4, 5]))
    assert verdict.path == [0, 1, 2]
    assert verdict.bonus == 4
    assert verdict.accepted == 2 and verdict.evaluated == 3


def test_greedy_all_accepted_gives_bonus():
    tree = TokenTree.chain(0, [1, 2])
    verdict = verify_greedy(tree, onehot_logits([1, 2, 5]))
    assert verdict.path == [0, 1, 2] and verdict.bonus == 5


def test_greedy_follows_the_matching_branch():
    tree = TokenTree(0)
    tree.add(3, 0)
    b = tree.add(4, 0)
    c = tree.add(5, b)
    verdict = verify_greedy(tree, onehot_logits([4, 0, 5, 1]))
    assert verdict.path == [0, b, c] and verdict.bonus == 1


def test_speculative_deterministic_outcomes():
    g = torch.Generator().manual_seed(0)
    tree = TokenTree(0)
    q = torch.tensor([0.0, 0.5, 0.5, 0.0])
    tree.set_children_kind(0, SAMPLED, q)
    tree.add(1, 0, 0.5)
    # p(1) = 0 -> always rejected; residual max(p - q, 0) puts all mass on token 3
    p = torch.tensor([[0.0, 0.0, 0.2, 0.8], [0.25, 0.25, 0.25, 0.25]])
    for _ in range(20):
        v = verify_speculative(tree, p, g)
        assert v.path == [0] and v.bonus == 3
    # p(1) >= q(1) -> always accepted
    p = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    for _ in range(20):
        v = verify_speculative(tree, p, g)
        assert v.path == [0, 1] and v.bonus == 2


def _empirical(counts, n):
    return {k: v / n for k, v in counts.items()}


def _tv(p_emp: dict, p_true: torch.Tensor) -> float:
    return 0.5 * sum(abs(p_emp.get(i, 0.0) - float(p_true[i])) for i in range(len(p_true)))


@pytest.mark.parametrize("kind", [SAMPLED, DETERMINISTIC])
def test_multi_branch_rejection_is_lossless(kind):
    """First emitted token of a 3-sibling tree is distributed exactly as p (TV < 0.015)."""
    g = torch.Generator().manual_seed(1)
    p = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    q = torch.tensor([0.3, 0.1, 0.3, 0.2, 0.1])
    n, counts = 20000, {}
    for _ in range(n):
        tree = TokenTree(0)
        if kind == SAMPLED:
            kids = torch.multinomial(q, 3, replacement=True, generator=g).tolist()
            tree.set_children_kind(0, SAMPLED, q)
        else:
            kids = [0, 2, 4]  # fixed "top-k" siblings regardless of p
            tree.set_children_kind(0, DETERMINISTIC)
        for t in kids:
            tree.add(t, 0, float(q[t]))
        scores = torch.stack([p] + [torch.full((5,), 0.2)] * len(kids))
        v = verify_speculative(tree, scores, g)
        first = tree.tokens[v.path[1]] if len(v.path) > 1 else v.bonus
        counts[first] = counts.get(first, 0) + 1
    assert _tv(_empirical(counts, n), p) < 0.015


def test_warp_top_k_top_p_and_greedy():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert warp_probs(logits, SamplingParams(0.0)).tolist() == [1.0, 0.0, 0.0, 0.0]
    k2 = warp_probs(logits, SamplingParams(1.0, top_k=2))
    assert torch.allclose(k2, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    p7 = warp_probs(logits, SamplingParams(1.0, top_p=0.7))  # keeps 0.5 and 0.3
    assert torch.allclose(p7, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    p9 = warp_probs(logits, SamplingParams(1.0, top_p=0.9))  # keeps 0.5, 0.3, 0.15
    assert p9[3] == 0 and p9[2] > 0


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-60, 1e-9, 2.0])
def test_warp_is_a_distribution_at_every_accepted_temperature(temperature):
    """A temperature too small to represent 1/T is greedy (no nan from inf - inf); the
    boundary values of the API's range all give a finite distribution."""
    logits = torch.tensor([[1.5, 7.25, -3.0, 7.0], [0.0, 0.0, -1e4, -2.0]])
    for top in ({}, {"top_k": 2}, {"top_p": 0.5}):
        p = warp_probs(logits, SamplingParams(temperature, **top))
        assert torch.isfinite(p).all() and (p >= 0).all(), (temperature, top, p)
        assert torch.allclose(p.sum(-1), torch.ones(2))
        if temperature <= 1e-9:  # the argmax (ties shared)
            assert p[0].tolist() == [0.0, 1.0, 0.0, 0.0]
            assert p[1].tolist()[:2] == [0.5, 0.5] or top
        token = torch.multinomial(p, 1)  # what failed with "inf, nan or element < 0"
        assert token.shape == (2, 1)


def test_typical_acceptance_threshold():
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(1.0)
    tree = TokenTree.chain(0, [1, 2])
    # node 0: p(1) = 0.6 passes; node 1: p(2) = 0.02 fails min(0.09, 0.3*exp(-H))
    l0 = torch.log(torch.tensor([0.1, 0.6, 0.1, 0.2]))
    l1 = torch.log(torch.tensor([0.49, 0.49, 0.02, 1e-9]))
    v = verify_typical_relaxed(tree, torch.stack([l0, l1, l1]), params, g)
    assert v.path == [0, 1]
    h = -sum(x * math.log(x) for x in [0.49, 0.49, 0.02])
    assert 0.02 < min(0.09, 0.3 * math.exp(-h))


def test_typical_acceptance_takes_the_longest_passing_path():
    """Medusa: root -> a (p=.5, leaf) and root -> b (p=.4) -> c (p=.9): accept b, c."""
    tree = TokenTree(0)
    tree.set_children_kind(0, "deterministic")
    a = tree.add(1, 0)
    b = tree.add(2, 0)
    tree.set_children_kind(b, "deterministic")
    c = tree.add(3, b)
    l_root = torch.log(torch.tensor([0.05, 0.5, 0.4, 0.05]))
    l_b = torch.log(torch.tensor([0.03, 0.03, 0.04, 0.9]))
    flat = torch.log(torch.full((4,), 0.25))
    logits = torch.stack([l_root, flat, l_b, flat])
    v = verify_typical_relaxed(tree, logits, SamplingParams(1.0), torch.Generator())
    assert v.path == [0, b, c] and a not in v.path


def test_top_p_keeps_the_most_probable_token():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = warp_probs(logits, SamplingParams(1.0, top_p=1e-80))
    assert not torch.isnan(p).any() and p.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_typical_judges_under_the_temperature_alone_and_takes_the_argmax_bonus():
    """Medusa's ``evaluate_posterior``: the criterion reads ``softmax(logits / T)`` (top-p
    does not enter it) and the bonus is the argmax, whatever the seed; ``bonus: sample``
    draws it from the warped distribution instead."""
    tree = TokenTree.chain(0, [1])
    l0 = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    l1 = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    logits = torch.stack([l0, l1])
    params = SamplingParams(1.0, top_p=0.5)  # warped: p(1) = 0 at the root
    bonuses = set()
    for seed in range(20):
        v = verify_typical_relaxed(tree, logits, params, torch.Generator().manual_seed(seed))
        assert v.path == [0, 1]  # 0.3 passes under softmax(logits / T)
        bonuses.add(v.bonus)
    assert bonuses == {0}
    sampled = {verify_typical_relaxed(tree, logits, SamplingParams(1.0),
                                      torch.Generator().manual_seed(s), bonus="sample").bonus
               for s in range(20)}
    assert len(sampled) > 1

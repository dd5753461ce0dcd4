"""Optimal tree search and SALF (Algorithm 2) against brute force, with fake draft models."""

import itertools

import pytest
import torch

from speclab.drafters import build_eagle2_tree, build_optimal_tree

VOCAB = 5


def fake_dist(seq: tuple[int, ...]) -> torch.Tensor:
    """A deterministic, path-dependent draft distribution over VOCAB tokens."""
    g = torch.Generator().manual_seed(hash(seq) % (2**31))
    return torch.softmax(torch.randn(VOCAB, generator=g) * 2.0, -1)


def seq_of(tree, node):
    return tuple(tree.tokens[i] for i in tree.path_to(node)[1:])


def fake_expand(tree, nodes):
    return torch.stack([fake_dist(seq_of(tree, n)) for n in nodes])


def brute_force_top(n: int, max_depth: int) -> list[tuple[tuple[int, ...], float]]:
    scored = []
    for d in range(1, max_depth + 1):
        for seq in itertools.product(range(VOCAB), repeat=d):
            pr = 1.0
            for i in range(d):
                pr *= float(fake_dist(seq[:i])[seq[i]])
            scored.append((seq, pr))
    scored.sort(key=lambda x: -x[1])
    return scored[:n]


@pytest.mark.parametrize("nodes,batch", [(8, 1), (12, 3), (20, 4), (30, 7)])
def test_optimal_tree_equals_brute_force_top_n(nodes, batch):
    max_depth = 4
    res = build_optimal_tree(0, fake_dist(()), fake_expand, nodes, batch, 0.0, max_depth)
    got = sorted(seq_of(res.tree, i) for i in range(1, len(res.tree)))
    want = sorted(seq for seq, _ in brute_force_top(nodes, max_depth))
    assert got == want
    assert len(res.tree) == nodes + 1


@pytest.mark.parametrize("nodes,batch", [(12, 3), (30, 4), (40, 2)])
def test_salf_sums_strictly_decrease(nodes, batch):
    res = build_optimal_tree(0, fake_dist(()), fake_expand, nodes, batch, 0.0, 6)
    sums = [s for s in res.sums if s > 0]
    assert len(sums) >= 3
    assert all(a > b for a, b in zip(sums, sums[1:])), sums


def test_salf_stops_early_and_yields_a_subset():
    full = build_optimal_tree(0, fake_dist(()), fake_expand, 30, 4, 0.0, 6)
    salf = build_optimal_tree(0, fake_dist(()), fake_expand, 30, 4, 0.5, 6)
    assert len(salf.sums) < len(full.sums)
    assert salf.sums[-1] < 0.5 <= min(salf.sums[:-1])
    for i in range(1, len(salf.tree)):  # every SALF node is a prefix-closed tree node
        assert salf.tree.parents[i] < i


def test_eagle2_tree_shape():
    calls = []

    def expand(tree, nodes):
        calls.append(len(nodes))
        return fake_expand(tree, nodes)

    tree, _ = build_eagle2_tree(0, fake_dist(()), expand, top_k=3, depth=4, nodes=10)
    assert len(tree) == 11
    assert calls == [3, 3, 3]  # top_k nodes expanded per level, one forward each
    assert max(tree.depths) <= 4
    probs = [tree.path_prob[i] for i in range(1, len(tree))]
    for i in range(1, len(tree)):  # kept nodes are the most probable candidates
        assert tree.path_prob[tree.parents[i]] >= tree.path_prob[i]
    assert min(probs) > 0

"""TokenTree masks, positions, tries and subtree selection on hand-built and random trees."""

import random

import torch

from speclab.decoding.host import inference, longs
from speclab.decoding.runner import tree_node_inputs
from speclab.decoding.tree import TokenTree, additive_mask, select_subtree


def test_chain_mask_is_causal_and_positions_follow_depth():
    tree = TokenTree.chain(7, [1, 2, 3])
    assert tree.is_chain()
    assert tree.depths == [0, 1, 2, 3]
    mask = tree.attention_mask(prefix_len=5)
    assert mask.shape == (4, 9)
    assert mask[:, :5].all()
    assert torch.equal(mask[:, 5:], torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    assert tree.position_ids(5).tolist() == [5, 6, 7, 8]


def test_branching_tree_mask():
    # root(0) -> a(1) -> c(3); root -> b(2) -> d(4)
    tree = TokenTree(9)
    a = tree.add(10, 0)
    b = tree.add(11, 0)
    c = tree.add(12, a)
    d = tree.add(13, b)
    assert not tree.is_chain()
    m = tree.attention_mask(prefix_len=2)[:, 2:].int().tolist()
    assert m == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 0, 1, 0, 1],
    ]
    assert tree.position_ids(2).tolist() == [2, 3, 3, 4, 4]
    assert tree.path_to(d) == [0, b, d]
    assert tree.path_to(c) == [0, a, c]


def test_atspeed_table3_flattened_beams():
    """AtSpeed Appendix A.3.1, Table 3: beams of 3 steps, beam size 2."""
    a1, a2, b1, b2, c1, c2 = 101, 102, 201, 202, 301, 302
    beams = [[a1, b1, c1], [a1, b1, c2], [a2, b2]]
    tree = TokenTree.from_sequences(0, beams)
    # flattened order "a1 a2 b1 b2 c1 c2" after the root
    assert tree.tokens[1:] == [a1, a2, b1, b2, c1, c2]
    names = ["root", "a1", "a2", "b1", "b2", "c1", "c2"]
    mask = tree.attention_mask(0)
    seen = {names[i]: [names[j] for j in range(len(names)) if mask[i, j]] for i in range(7)}
    assert seen["c2"] == ["root", "a1", "b1", "c2"]
    assert seen["c1"] == ["root", "a1", "b1", "c1"]
    assert seen["b2"] == ["root", "a2", "b2"]
    assert seen["b1"] == ["root", "a1", "b1"]
    assert seen["a2"] == ["root", "a2"]
    assert tree.position_ids(10).tolist() == [10, 11, 11, 12, 12, 13, 13]


def test_trie_merges_shared_prefixes():
    tree = TokenTree.from_sequences(0, [[1, 2, 3], [1, 2, 4], [1, 5]])
    assert len(tree) == 6  # root, 1, 2, 5, 3, 4
    assert tree.children[0] == [1]


def test_select_subtree_keeps_structure():
    tree = TokenTree(0)
    a = tree.add(1, 0, 0.5)
    b = tree.add(2, 0, 0.4)
    c = tree.add(3, a, 0.9)
    new, mapping = select_subtree(tree, [0, a, c])
    assert new.tokens == [0, 1, 3]
    assert new.parents == [-1, 0, 1]
    assert mapping == {0: 0, a: 1, c: 2}
    assert abs(new.path_prob[2] - 0.45) < 1e-9
    assert b not in mapping


def test_additive_mask_values():
    allowed = torch.tensor([[True, False]])
    m = additive_mask(allowed, torch.float32)
    assert m.shape == (1, 1, 1, 2)
    assert m[0, 0, 0, 0] == 0 and m[0, 0, 0, 1] == torch.finfo(torch.float32).min


def _random_tree(rng: random.Random, n: int) -> TokenTree:
    tree = TokenTree(rng.randrange(50))
    for _ in range(n):
        tree.add(rng.randrange(50), rng.randrange(len(tree)))
    return tree


def test_masks_equal_their_definition_on_random_trees():
    """The byte-buffer mask builders (ancestor_matrix, attention_mask, the draft side's
    tree_node_inputs) against the definition: a node sees the prefix, its ancestors and
    itself."""
    rng = random.Random(0)
    for n in (0, 1, 5, 17):
        tree = _random_tree(rng, n)
        size = len(tree)
        want = torch.zeros(size, size, dtype=torch.bool)
        for i in range(size):
            for j in tree.path_to(i):
                want[i, j] = True
        assert torch.equal(tree.ancestor_matrix(), want)
        full = tree.attention_mask(prefix_len=3)
        assert full.shape == (size, 3 + size) and full[:, :3].all()
        assert torch.equal(full[:, 3:], want)
        # the draft side appends nodes 1.. in two forwards after a prefix of 4 (root at 3)
        slot, base = {0: 3}, 4
        first, second = list(range(1, size // 2 + 1)), list(range(size // 2 + 1, size))
        for nodes, length in ((first, base), (second, base + len(first))):
            if not nodes:
                continue
            tokens, positions, allowed = tree_node_inputs(length, tree, nodes, base, slot)
            assert tokens.tolist() == [tree.tokens[i] for i in nodes]
            assert positions.tolist() == [base - 1 + tree.depths[i] for i in nodes]
            want_rows = torch.zeros(len(nodes), length + len(nodes), dtype=torch.bool)
            want_rows[:, :base] = True
            for r, node in enumerate(nodes):
                for j in tree.path_to(node)[1:]:
                    want_rows[r, slot[j]] = True
            if allowed is None:  # only a single node that sees every position is causal
                assert len(nodes) == 1 and want_rows.all()
            else:
                assert torch.equal(allowed, want_rows)


def test_longs_and_inference_helpers():
    assert longs([]).shape == (0,) and longs([]).dtype == torch.long
    t = longs([3, -1, 2**40])
    assert t.dtype == torch.long and t.tolist() == [3, -1, 2**40]

    @inference
    def inside() -> bool:
        return torch.is_inference_mode_enabled()

    assert not torch.is_inference_mode_enabled() and inside()
    with torch.inference_mode():
        assert inside()
    assert not torch.is_inference_mode_enabled()

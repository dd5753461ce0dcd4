"""After pruning, the KV cache equals a cache recomputed from scratch for the kept tokens."""

import torch

from speclab.decoding.runner import ModelRunner
from speclab.decoding.tree import TokenTree
from speclab.models.loading import load_model


def test_tree_forward_matches_per_path_and_pruned_cache_matches_recompute(tiny_pair):
    model = load_model(tiny_pair["target"])
    prefix = torch.tensor([3, 9, 27, 17, 51, 2])
    runner = ModelRunner(model)
    runner.reset()
    runner.forward(prefix)
    tree = TokenTree.from_sequences(5, [[10, 11, 12], [10, 13], [14, 15, 16, 17]])
    logits = runner.forward(tree.token_tensor(), tree.position_ids(6), tree.attention_mask(6))

    for leaf in range(len(tree)):
        path = tree.path_to(leaf)
        fresh = ModelRunner(model)
        fresh.reset()
        full = fresh.forward(torch.cat([prefix, torch.tensor([tree.tokens[i] for i in path])]))
        torch.testing.assert_close(logits[path], full[6:], atol=1e-5, rtol=1e-4)

    path = tree.path_to(len(tree) - 1)  # root -> 14 -> 15 -> 16 -> 17
    runner.keep(list(range(6)) + [6 + i for i in path])
    recomputed = ModelRunner(model)
    recomputed.reset()
    kept_tokens = torch.cat([prefix, torch.tensor([tree.tokens[i] for i in path])])
    recomputed.forward(kept_tokens)
    assert runner.length == recomputed.length == len(kept_tokens)
    for a, b in zip(runner.cache.layers, recomputed.cache.layers):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-4)
    nxt = torch.tensor([40, 41])
    torch.testing.assert_close(runner.forward(nxt), recomputed.forward(nxt), atol=1e-5, rtol=1e-4)


def test_crop_drops_tail(tiny_pair):
    runner = ModelRunner(load_model(tiny_pair["target"]))
    runner.reset()
    runner.forward(torch.arange(10))
    runner.crop(4)
    assert runner.length == 4 and runner.cache.get_seq_length() == 4

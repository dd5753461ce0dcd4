"""Retrieval drafting: draft pool, datastore, alignment sampling, conditional
verification (AASD eq. 4-6), PLD losslessness and parity with HF prompt lookup."""

import math

import numpy as np
import pytest
import torch

from speclab.api import Decoder
from speclab.decoding.datastore import Datastore, suffix_array
from speclab.decoding.rules import RuleSpec, conditional_threshold, verify_conditional
from speclab.decoding.tree import TokenTree
from speclab.drafters.pld import DraftPool, PromptLookupDrafter
from speclab.drafters.rest import RestDrafter
from speclab.text_metrics import edit_sim, rouge_l, token_f1


def test_draft_pool_keys_longest_first_and_updates():
    pool = DraftPool(max_key=3)
    pool.extend([1, 2, 3, 9, 2, 3, 7, 1, 2, 3])
    # all keys of length 1..3 ending at each position are indexed
    assert pool.index[(1, 2, 3)] == [3, 10] and pool.index[(2, 3)] == [3, 6, 10]
    assert (9,) in pool.index and (3, 9, 2) in pool.index and (1, 2, 3, 9) not in pool.index
    k, starts = pool.lookup(5)  # suffix (1, 2, 3) occurred before: the longest key wins
    assert k == 3 and starts == [3]  # the occurrence at the very end is excluded
    pool.extend([4])
    k, starts = pool.lookup(5)  # suffix (2, 3, 4) / (3, 4) unseen, (4,) unseen -> nothing
    assert (k, starts) == (0, [])
    pool.extend([2, 3])
    k, starts = pool.lookup(5)  # (4, 2, 3) unseen; (2, 3) seen 3 times: most recent first
    assert k == 2 and starts == [10, 6, 3]
    with pytest.raises(ValueError, match="max_key"):
        DraftPool(0)


def test_pld_drafts_the_continuations_as_a_trie():
    d = PromptLookupDrafter(ngram=3, max_key=2, candidates=2)
    d.reset()
    tree = d.propose([5, 6, 7, 8, 5, 6, 9, 1, 5, 6], budget=10)
    # key (5, 6) occurred at 0 and 4: continuations [9, 1, 5] (recent) and [7, 8, 5]
    paths = {tuple(tree.tokens[n] for n in tree.path_to(leaf)[1:])
             for leaf in range(len(tree)) if not tree.children[leaf]}
    assert paths == {(9, 1, 5), (7, 8, 5)}
    assert not any(tree.relaxed) and d.rule is None  # plain PLD: strict


def test_suffix_array_and_datastore_retrieval(tmp_path):
    rng = np.random.default_rng(0)
    for n in (1, 7, 200):
        toks = rng.integers(0, 3, n)
        assert list(suffix_array(toks, 10_000)) == sorted(range(n), key=lambda i: tuple(toks[i:]))
    docs = [[1, 2, 3, 4, 5], [1, 2, 3, 9], [7, 1, 2, 3, 4, 6], [1, 2, 3, 4, 5, 8]]
    store = Datastore.build(docs)
    conts = store.continuations([1, 2, 3], 2, 10)
    assert conts[0] == [4, 5]  # twice, the most frequent
    assert sorted(map(tuple, conts)) == [(4, 5), (4, 6), (9,)]  # never crosses documents
    assert store.continuations([3, 9], 3, 5) == []  # doc 2 ends after 9
    assert store.continuations([42], 3, 5) == []
    back = Datastore.load(store.save(tmp_path / "ds"))
    assert back.continuations([1, 2, 3], 2, 10) == conts and back.num_tokens == 21
    rest = RestDrafter(back, ngram=2, max_key=4, candidates=4)
    tree = rest.propose([0, 7, 1, 2, 3], 8)  # the longest key (7, 1, 2, 3) wins: 4, 6
    assert tree.tokens == [3, 4, 6]
    tree = rest.propose([0, 9, 1, 2, 3], 8)  # (9, 1, 2, 3) unseen -> (1, 2, 3)
    assert len(tree) == 1 + 4  # trie of 4,5 / 4,6 / 9 -> nodes 4, 9, 5, 6
    with pytest.raises(ValueError, match="datastore: no datastore"):
        Datastore.load(tmp_path / "missing")


def test_alignment_sampling_on_hand_made_prefill():
    prompt = [10, 11, 12, 13, 10, 11]
    # prefill row i predicts prompt[i + 1]; vocabulary of 20
    logits = torch.full((len(prompt) - 1, 20), -5.0)
    logits[0, 11] = 5.0  # predicts 11 at position 1: aligned
    logits[1, 3], logits[1, 4], logits[1, 12] = 5.0, 4.0, 3.0  # position 2 holds 12: misaligned
    logits[2, 13] = 5.0
    d = PromptLookupDrafter(ngram=3, max_key=2, candidates=1, align_k=2, relax=(0.1, 0.1))
    d.start(prompt, logits.topk(d.prefill_top_k, dim=-1).indices.tolist())
    tree = d.propose(prompt, budget=8)
    # key (10, 11) -> continuation from position 2: 12, 13, 10
    first = tree.children[0]
    assert [tree.tokens[c] for c in first] == [12, 3, 4]  # + the 2 top prefill tokens
    assert all(tree.relaxed[c] for c in first)  # prompt-retrieved and alignment-sampled
    n12 = first[0]
    assert [tree.tokens[c] for c in tree.children[n12]] == [13]  # aligned: no siblings
    assert d.rule == RuleSpec("conditional", {"alpha": 0.1, "beta": 0.1})


def test_conditional_threshold_hand_values():
    p = torch.tensor([0.5, 0.25, 0.25])
    h = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))
    assert float(conditional_threshold(p, 0.1, 0.1)) == pytest.approx(0.1 * h + 0.1)
    peaked = torch.tensor([0.98, 0.01, 0.01])  # capped by max p: the top token passes
    assert float(conditional_threshold(peaked, 10.0, 0.5)) == pytest.approx(0.98)
    flat = torch.full((4,), 0.25)
    assert float(conditional_threshold(flat, 1.0, 0.0)) == pytest.approx(0.25)  # all pass


def test_verify_conditional_accepts_relaxed_nodes_and_the_longest_path():
    tree = TokenTree(0)
    a = tree.add(1, 0, relaxed=True)  # not the argmax, p = 0.3
    b = tree.add(2, 0)  # the argmax, strict
    a2 = tree.add(3, a, relaxed=True)
    a3 = tree.add(4, a2, relaxed=False)  # strict, not the argmax: rejected
    logits = torch.full((len(tree), 6), -9.0)
    logits[0, 2], logits[0, 1] = math.log(0.6), math.log(0.3)
    logits[a, 3] = 5.0
    logits[a2, 5] = 5.0
    logits[b, 5] = 5.0
    v = verify_conditional(tree, logits, 0.1, 0.1)
    # (1 -> 3) passes by threshold and is longer than (2); 4 is strict and not argmax
    assert v.path == [0, a, a2] and v.bonus == 5
    strict = verify_conditional(tree, logits, 0.1, 10.0)  # huge beta: only argmaxes pass
    assert strict.path == [0, b] and a3 not in strict.path
    with pytest.raises(ValueError, match="aasd_alpha"):
        verify_conditional(tree, logits, -0.1, 0.1)


def test_text_metrics():
    assert edit_sim("abc", "abc") == 1.0 and edit_sim("abc", "abd") == pytest.approx(2 / 3)
    assert token_f1("the cat sat", "a cat sat down") == pytest.approx(2 * (2/3 * 2/4) / (2/3 + 2/4))
    assert rouge_l("a b c d", "a c d") == pytest.approx(2 * (3/4 * 1) / (3/4 + 1))


REPETITIVE = [5, 9, 13, 2, 7, 30, 5, 9, 13, 2, 8, 30, 5, 9, 13, 2, 7, 41, 5, 9]


def test_pld_is_lossless_and_matches_hf_prompt_lookup(tiny_pair):
    dec = Decoder.from_pretrained(tiny_pair["target"])
    model = dec.target.model
    for prompt in (REPETITIVE, REPETITIVE[3:] + [5, 9, 13]):
        ar = dec.generate(prompt_ids=prompt, method="ar", max_new_tokens=24).token_ids
        x = torch.tensor([prompt])
        hf = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                            max_new_tokens=24, prompt_lookup_num_tokens=10,
                            pad_token_id=0)[0, len(prompt):].tolist()
        for kw in ({}, {"candidates": 3, "ngram": 4, "max_key": 2}):
            res = dec.generate(prompt_ids=prompt, method="pld", max_new_tokens=24, **kw)
            assert res.token_ids == ar == hf
        aasd = dec.generate(prompt_ids=prompt, method="aasd", conditional=False,
                            max_new_tokens=24)
        assert aasd.token_ids == ar  # alignment sampling alone is still lossless


def test_retrieval_bad_input(tmp_path, tiny_pair):
    dec = Decoder.from_pretrained(tiny_pair["target"])
    with pytest.raises(ValueError, match="ngram"):
        dec.generate(prompt_ids=[1, 2], method="pld", ngram=0, max_new_tokens=4)
    with pytest.raises(ValueError, match="max_key"):
        dec.generate(prompt_ids=[1, 2], method="aasd", max_key=0, max_new_tokens=4)
    with pytest.raises(ValueError, match="aasd_alpha"):
        dec.generate(prompt_ids=[1, 2], method="aasd", aasd_alpha=-1.0, max_new_tokens=4)
    with pytest.raises(ValueError, match="datastore: no datastore"):
        dec.generate(prompt_ids=[1, 2], method="rest", datastore=str(tmp_path / "nope"),
                     max_new_tokens=4)
    with pytest.raises(ValueError, match="datastore: method 'rest' needs"):
        dec.generate(prompt_ids=[1, 2], method="rest", max_new_tokens=4)

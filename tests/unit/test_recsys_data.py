"""AtSpeed data: synthetic interactions, loaders, chronological split, semantic ids."""

import json

import pytest
import torch

from speclab.data import recsys
from speclab.decoding.trie import ItemTrie


def test_synthetic_data_has_structure():
    spec = recsys.SyntheticSpec(users=200, items=150, seed=1)
    events, feats = recsys.synthetic_interactions(spec)
    assert feats.shape == (150, 16)
    per_user = {}
    for e in events:
        per_user.setdefault(e.user, []).append(e)
    assert len(per_user) == 200
    assert all(5 <= len(v) <= 20 for v in per_user.values())
    assert all(a.timestamp < b.timestamp for v in per_user.values() for a, b in zip(v, v[1:]))
    counts = torch.bincount(torch.tensor([e.item for e in events]), minlength=150)
    top = counts.sort(descending=True).values
    assert top[:15].sum() > 3 * top[-15:].sum()  # popularity skew
    # sequential dependency: consecutive items are more similar than random pairs
    unit = torch.nn.functional.normalize(feats, dim=-1)
    seq_sim = torch.tensor([float(unit[a.item] @ unit[b.item])
                            for v in per_user.values() for a, b in zip(v, v[1:])]).mean()
    rand_sim = (unit @ unit.T).mean()
    assert seq_sim > rand_sim + 0.1


def test_chronological_split_is_8_1_1_in_time():
    events, _ = recsys.synthetic_interactions(recsys.SyntheticSpec(users=50, items=40))
    train, val, test = recsys.chronological_split(events)
    assert len(train) + len(val) + len(test) == len(events)
    assert abs(len(train) / len(events) - 0.8) < 0.01
    assert max(e.timestamp for e in train) <= min(e.timestamp for e in val)
    assert max(e.timestamp for e in val) <= min(e.timestamp for e in test)


def test_semantic_ids_are_unique_and_form_a_trie():
    spec = recsys.SyntheticSpec(users=10, items=300, seed=2)
    feats = recsys.item_features(spec)
    ids = recsys.semantic_ids(feats, levels=4, codebook=8)
    assert len(set(ids)) == 300 and all(len(i) == 4 for i in ids)
    assert all(0 <= c < 8 for i in ids for c in i)
    tokens = recsys.id_tokens(ids, offset=10, codebook=8)
    trie = ItemTrie(tokens, items=list(range(300)))
    assert trie.allowed(())  and all(10 <= t < 18 for t in trie.allowed(()))
    assert trie.item_of(tokens[17]) == 17
    # ids are semantic: nearest-neighbour items share the first code far more than random pairs
    d = torch.cdist(feats, feats)
    d.fill_diagonal_(float("inf"))
    nn = d.argmin(-1).tolist()
    near = sum(ids[i][0] == ids[j][0] for i, j in enumerate(nn)) / 300
    rand = sum(ids[i][0] == ids[(i * 7 + 13) % 300][0] for i in range(300)) / 300
    assert near > 0.8 and near > 2 * rand, (near, rand)
    with pytest.raises(ValueError, match="cannot name"):
        recsys.semantic_ids(feats, levels=2, codebook=8)


def test_loaders(tmp_path):
    amazon = tmp_path / "beauty.jsonl"
    amazon.write_text("\n".join(json.dumps(r) for r in [
        {"reviewerID": "A1", "asin": "B9", "unixReviewTime": 5, "title": "x"},
        {"reviewerID": "A2", "asin": "B9", "unixReviewTime": 3},
        {"reviewerID": "A1", "asin": "B7", "unixReviewTime": 9}]))
    ev = recsys.load_amazon_jsonl(amazon)
    assert [(e.user, e.item, e.timestamp) for e in ev] == [(0, 0, 5), (1, 0, 3), (0, 1, 9)]
    ml = tmp_path / "ratings.dat"
    ml.write_text("1::1193::5::978300760\n1::661::3::978302109\n")
    assert recsys.load_movielens(ml)[1].item == 661
    (tmp_path / "bad.dat").write_text("1,2,3\n")
    with pytest.raises(ValueError, match="bad.dat:1"):
        recsys.load_movielens(tmp_path / "bad.dat")

"""Drafting ahead's tree logic (speclab.decoding.lookahead), no model: the guessed
path, subtrees, the translation between sent and drafted trees, hits and misses, and
the rule that switches drafting ahead off."""

import pytest
import torch

from speclab.decoding.lookahead import Ahead, RowAhead, guess_path, subtree
from speclab.decoding.tree import DETERMINISTIC, SAMPLED, TokenTree


def _tree() -> TokenTree:
    """root 5 -> {7 (0.6) -> {8 (0.3), 9 (0.5) -> 4 (0.9)}, 6 (0.4) -> 3 (0.2)}"""
    t = TokenTree(5)
    t.set_children_kind(0, DETERMINISTIC)
    a, b = t.add(7, 0, 0.6), t.add(6, 0, 0.4)
    t.set_children_kind(a, DETERMINISTIC)
    t.set_children_kind(b, SAMPLED, torch.full((10,), 0.1))
    c, d, e = t.add(8, a, 0.3), t.add(9, a, 0.5), t.add(3, b, 0.2)
    t.set_children_kind(d, DETERMINISTIC)
    t.add(4, d, 0.9)
    assert (a, b, c, d, e) == (1, 2, 3, 4, 5)
    return t


def test_the_guess_follows_the_likeliest_child_down_to_a_leaf():
    assert guess_path(_tree()) == [0, 1, 4, 6]
    assert guess_path(TokenTree.chain(1, [2, 3, 4])) == [0, 1, 2, 3]
    assert guess_path(TokenTree(1)) == [0]


def test_a_subtree_keeps_its_nodes_probabilities_kinds_and_a_depth_limit():
    t = _tree()
    sub, old = subtree(t, 1, 5)
    assert sub.tokens == [7, 8, 9, 4] and old == [1, 3, 4, 6]
    assert sub.parents == [-1, 0, 0, 2] and sub.q_prob[1:] == [0.3, 0.5, 0.9]
    assert sub.child_kind == {0: DETERMINISTIC, 2: DETERMINISTIC}
    short, old = subtree(t, 0, 1)
    assert short.tokens == [5, 7, 6] and old == [0, 1, 2] and 1 not in short.child_kind
    sampled, _ = subtree(t, 2, 3)
    assert sampled.child_kind == {0: SAMPLED} and torch.equal(sampled.q_dist[0], t.q_dist[2])
    assert TokenTree.from_wire(sub.to_wire()).tokens == sub.tokens


def test_a_hit_hands_out_the_subtree_under_the_bonus_and_translates_the_next_verdict():
    row = RowAhead(committed=10)
    row.sent_tree(TokenTree.chain(5, [7, 9]), budget=6)
    path, mine, tokens, levels = row.plan()
    assert (path, mine, tokens, levels) == ([0, 1, 2], [0, 1, 2], [7, 9], 4)
    drafted = TokenTree.chain(9, [4, 2, 1])  # the drafter's tree, rooted at the guess's end
    drafted.add(3, 0, 0.5)  # a second bonus candidate
    row.pending = Ahead(path, tokens, drafted)
    sent = row.take([0, 1, 2], [7, 9, 3], budget=3)
    assert sent.tokens == [3] and row.prefix_nodes == [0, 4] and row.prefix_tokens == [3]
    row.pending = Ahead(path, tokens, drafted)
    sent = row.take([0, 1, 2], [7, 9, 4], budget=2)
    assert sent.tokens == [4, 2, 1] and row.view == [1, 2, 3]
    # the next verdict on the sent subtree, as the drafter's own tree sees it
    assert row.translate([0, 1], [2, 8]) == ([0, 1, 2], [4, 2, 8])
    assert row.translate(None, [8]) == (None, [4, 8])


def test_misses_another_path_another_bonus_or_no_tree():
    row = RowAhead()
    row.sent_tree(TokenTree.chain(5, [7, 9]), budget=6)
    drafted = TokenTree.chain(9, [4, 2])
    for verdict in (([0, 1], [7, 8]), ([0, 1, 2], [7, 9, 6])):
        row.pending = Ahead([0, 1, 2], [7, 9], drafted)
        assert row.take(*verdict, budget=3) is None and row.pending is None
        assert row.view is None and row.prefix_tokens == []  # the sent tree is unchanged
    row.pending = Ahead([0, 1, 2], [7, 9], None)
    assert row.take([0, 1, 2], [7, 9, 4], budget=3) is None
    assert row.take([0, 1, 2], [7, 9, 4], budget=3) is None  # nothing pending


def test_nothing_to_guess_without_drafts_or_without_a_next_round():
    row = RowAhead()
    row.sent_tree(TokenTree(5), budget=6)
    assert row.plan() is None
    row.sent_tree(TokenTree.chain(5, [7, 9]), budget=3)  # next round: 3 - 3 = 0 levels
    assert row.plan() is None
    row.sent_tree(TokenTree.chain(5, [7, 9]), budget=4)
    assert row.plan()[3] == 2


def test_drafting_ahead_stops_when_hits_are_rare_or_cost_more_than_they_save():
    row = RowAhead()
    for _ in range(7):
        row.record(False)
    assert row.worth_it(warmup=8, min_hit_rate=0.2)  # still warming up
    row.record(True)
    row.charge(saved_s=0.004)
    assert not row.worth_it(warmup=8, min_hit_rate=0.2)  # 1 hit in 8 rounds
    row.record(True)
    row.charge(saved_s=0.004)
    assert row.worth_it(warmup=8, min_hit_rate=0.2)  # 2 in 9, saving time
    row.charge(lost_s=0.01)
    assert not row.worth_it(warmup=8, min_hit_rate=0.2)  # it cost more than it saved


def test_the_replica_keeps_drafting_ahead_only_where_it_measured_faster():
    from speclab.decoding.lookahead import AheadTrial

    trial = AheadTrial(block=2, hold=3)
    modes = []
    for rate_on, rate_off in ((10.0, 20.0), (30.0, 20.0)):  # tokens per second
        for _ in range(4):  # a block with, a block without
            mode = trial.on()
            modes.append(mode)
            trial.record(mode, int(rate_on if mode else rate_off), 1.0)
        assert trial.rates == {True: rate_on, False: rate_off}
        held = []
        for _ in range(3):
            held.append(trial.on())
            trial.record(held[-1], 1, 1.0)
        assert held == [rate_on > rate_off] * 3
    assert modes == [True, True, False, False] * 2
    with pytest.raises(ValueError, match="block"):
        AheadTrial(block=0)

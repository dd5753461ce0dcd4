"""The batched engine: rows decoded together equal the rows decoded alone.

Ragged prompts (1 to 11 tokens), ragged trees (every row drafts its own), rows that
finish at different times (EOS) and rows that join mid-run (``batch_size`` smaller than
the number of prompts) are all exercised.
"""

import json

import pytest
import torch

from speclab.api import Decoder
from speclab.decoding.batch_runner import BatchRunner, prefill_groups
from speclab.decoding.drafting import PerRowDrafters
from speclab.decoding.runner import ModelRunner
from speclab.decoding.sampling import SamplingParams
from speclab.drafters.batched import BatchModelDrafter
from speclab.drafters.registry import BuildContext, make_batch_drafter, parse_method

from .test_engine_greedy import SETTINGS, prompts

EXTRA = [("pld", {}), ("aasd", {}), ("pld", {"candidates": 3, "ngram": 4})]


def test_batch_runner_logits_equal_single_rows(tiny_pair):
    """Ragged prefill, then ragged tree forwards: each row's logits are the single-row
    runner's; dropping and adding rows keeps the others intact."""
    dec = Decoder.from_pretrained(tiny_pair["target"])
    model = dec.target.model
    seqs = [[1, 2, 3, 4, 5], [7], [9, 8, 7, 6, 5, 4, 3, 2], [3, 3]]
    batch = BatchRunner(model)
    pre = batch.add_rows([s[:-1] for s in seqs])
    singles = []
    for b, s in enumerate(seqs):
        one = ModelRunner(model)
        one.reset()
        if len(s) > 1:
            torch.testing.assert_close(pre[b, :len(s) - 1], one.forward(torch.tensor(s[:-1])))
        singles.append(one)
    # a causal chain on row 0, a 3-node tree on row 2, nothing on row 3, one token on row 1
    allowed = torch.ones(3, 7 + 3, dtype=torch.bool)
    allowed[1, 7 + 2] = allowed[2, 7 + 1] = False  # siblings 1 and 2 under node 0
    positions = torch.tensor([7, 8, 8])
    inputs = [torch.tensor([5, 6]), torch.tensor([7]), torch.tensor([2, 4, 1]),
              torch.zeros(0, dtype=torch.long)]
    got = batch.forward(inputs, [None, None, positions, None], [None, None, allowed, None])
    want = [singles[0].forward(inputs[0]), singles[1].forward(inputs[1]),
            singles[2].forward(inputs[2], positions, allowed)]
    for b, w in enumerate(want):
        torch.testing.assert_close(got[b, :w.shape[0]], w, atol=1e-5, rtol=1e-5)
    assert [batch.length(b) for b in range(4)] == [6, 1, 10, 1]
    # row 2 keeps node 1 only; then rows leave and a row joins; the rest still match
    batch.keep(2, list(range(7)) + [8])
    singles[2].keep(list(range(7)) + [8])
    batch.drop([0, 1])
    batch.add_rows([[4, 4, 4]])
    batch.compact()
    nxt = batch.forward([torch.tensor([9]), torch.tensor([5]), torch.tensor([6])])
    torch.testing.assert_close(nxt[0, :1], singles[2].forward(torch.tensor([9])), atol=1e-5,
                               rtol=1e-5)
    torch.testing.assert_close(nxt[1, :1], singles[3].forward(torch.tensor([5])), atol=1e-5,
                               rtol=1e-5)
    assert batch.rows == 3 and batch.width == max(batch.length(b) for b in range(3))


def test_a_row_leaving_keeps_the_cache_buffer_and_its_spare_room(tiny_pair):
    """A dropped row's rows are taken from the whole preallocated buffer: the next forward
    writes into the spare capacity (no reallocation and copy of the whole cache, what a
    row's leaving cost before), and the rows left decode as they would alone."""
    model = Decoder.from_pretrained(tiny_pair["target"]).target.model
    seqs = [[1, 2, 3], [4, 5, 6, 7], [8]]
    batch, alone = BatchRunner(model), ModelRunner(model)
    batch.add_rows(seqs)
    alone.reset()
    alone.forward(torch.tensor(seqs[1]))
    batch.forward([torch.tensor([5])] * 3)
    alone.forward(torch.tensor([5]))
    layer = batch.cache.layers[0]
    room = layer._k.shape[2]
    assert room > layer.keys.shape[2]  # spare capacity to keep
    batch.drop([0, 2])
    buffer = layer._k
    assert buffer.shape[:3] == (1, layer.keys.shape[1], room)
    got = batch.forward([torch.tensor([9])])
    assert layer._k is buffer  # written in place
    torch.testing.assert_close(got[0, :1], alone.forward(torch.tensor([9])), atol=1e-5,
                               rtol=1e-5)


def test_a_row_leaving_moves_the_rows_after_it_in_place_and_a_join_leaves_spare_room(
        tiny_pair):
    """A middle row's leaving moves the rows after it down inside the same storage (no
    new buffer); rows joining a batch are merged into ONE buffer with spare capacity, so
    the forward after a join writes in place; every row still decodes as it would alone."""
    model = Decoder.from_pretrained(tiny_pair["target"]).target.model
    seqs = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    batch = BatchRunner(model)
    batch.add_rows(seqs)
    alone = {}
    for b in (0, 2):
        alone[b] = ModelRunner(model)
        alone[b].reset()
        alone[b].forward(torch.tensor(seqs[b]))
    layer = batch.cache.layers[0]
    storage = layer._k.untyped_storage().data_ptr()
    batch.drop([1])
    assert layer._k.shape[0] == 2 and layer._k.untyped_storage().data_ptr() == storage
    got = batch.forward([torch.tensor([5]), torch.tensor([6])])
    for row, b in enumerate((0, 2)):
        torch.testing.assert_close(got[row, :1], alone[b].forward(torch.tensor([5 + row])),
                                   atol=1e-5, rtol=1e-5)
    joined = ModelRunner(model)
    joined.reset()
    joined.forward(torch.tensor([3, 1, 4, 1, 5, 9]))
    batch.add_rows([[3, 1, 4, 1, 5, 9]])
    assert layer._k.shape[0] == 3 and layer._k.shape[2] > batch.width  # spare room
    buffer = layer._k
    got = batch.forward([torch.tensor([7]), torch.tensor([7]), torch.tensor([2])])
    assert layer._k is buffer  # written in place: no reallocation after the join
    torch.testing.assert_close(got[0, :1], alone[0].forward(torch.tensor([7])), atol=1e-5,
                               rtol=1e-5)
    torch.testing.assert_close(got[1, :1], alone[2].forward(torch.tensor([7])), atol=1e-5,
                               rtol=1e-5)
    torch.testing.assert_close(got[2, :1], joined.forward(torch.tensor([2])), atol=1e-5,
                               rtol=1e-5)



def test_logits_at_computes_each_rows_wanted_position_only(tiny_pair):
    """``forward(..., logits_at=[...])`` (a drafter's catch-up, which reads each row's
    last logits) returns ``[B, 1, V]``: row ``b``'s logits at its index, equal to the
    full forward's there, with the LM head run at the rows' distinct positions only."""
    model = Decoder.from_pretrained(tiny_pair["target"]).target.model
    seqs, new = [[1, 2, 3], [4, 5], [6]], [[7, 8, 9], [1], [2, 3]]
    full, part = BatchRunner(model), BatchRunner(model)
    for r in (full, part):
        r.add_rows(seqs)
    want = full.forward([torch.tensor(t) for t in new])
    heads = []
    call = part.call_model
    part.call_model = lambda ids, pos, mask, keep: (heads.append(keep), call(ids, pos, mask,
                                                                            keep))[1]
    at = [len(t) - 1 for t in new]
    got = part.forward([torch.tensor(t) for t in new], logits_at=at)
    assert got.shape == (3, 1, want.shape[-1]) and heads[0].tolist() == [0, 1, 2]
    for b, i in enumerate(at):
        torch.testing.assert_close(got[b, 0], want[b, i], atol=1e-5, rtol=1e-5)


def test_with_tracked_features_the_lm_head_runs_at_the_wanted_positions_only(tiny_pair):
    """A target whose hidden states are tracked (a feature drafter's): ``logits_at`` and
    ``last_only`` feed the LM head the wanted positions only, and the kept states stay
    every position's."""
    model = Decoder.from_pretrained(tiny_pair["target"]).target.model
    seqs, new = [[1, 2, 3], [4, 5], [6]], [[7, 8, 9], [1], [2, 3, 4]]
    full, part = BatchRunner(model), BatchRunner(model)
    for r in (full, part):
        r.track_hidden("eagle3")
        r.add_rows(seqs)
    want = full.forward([torch.tensor(t) for t in new])
    want_states = full.features("eagle3")
    seen = []
    handle = model.get_output_embeddings().register_forward_pre_hook(
        lambda _m, args: seen.append(tuple(args[0].shape)))
    try:
        at = [len(t) - 1 for t in new]
        got = part.forward([torch.tensor(t) for t in new], logits_at=at)
        torch.testing.assert_close(part.features("eagle3"), want_states)
        assert part.features(None).shape[:2] == (3, 3)
        # each row reads its own from ONE concatenation per forward
        assert part.features("eagle3") is part.features("eagle3")
        part.add_rows([[9, 9, 9, 9]], logits=False)
    finally:
        handle.remove()
    h = model.config.hidden_size  # (this hook runs after the runners', on their cut)
    assert seen == [(3, 2, h), (1, 1, h)]  # positions 0 and 2 of 3; the prefill's last
    for b, i in enumerate(at):
        torch.testing.assert_close(got[b, 0], want[b, i], atol=1e-5, rtol=1e-5)


def test_prefill_groups_bound_the_padding():
    """Longest first; a group takes rows at least half as long as its longest, and every
    row once its longest is at most the floor."""
    assert prefill_groups([150, 20, 90, 3, 160]) == [[4, 0, 2], [1, 3]]
    assert prefill_groups([10, 60, 1]) == [[1, 0, 2]]
    assert prefill_groups([400, 100, 190]) == [[0], [2, 1]]
    assert prefill_groups([]) == []


def test_a_ragged_prefill_runs_in_groups_and_keeps_the_rows_order(tiny_pair):
    """Rows joining with prompts of very different lengths are prefilled one forward per
    group (not all padded to the longest); their logits, their tracked features and the
    next forward are each row's alone, in the order the rows were given."""
    model = Decoder.from_pretrained(tiny_pair["target"]).target.model
    seqs = [[(7 * i + 3 * n) % 50 + 1 for i in range(n)] for n in (150, 20, 90, 3, 160)]
    batch = BatchRunner(model)
    batch.track_hidden()
    batch.add_rows([[5, 6, 7]])  # a row already decoding: the new rows go after it
    calls = batch.calls
    pre = batch.add_rows(seqs)
    assert batch.calls == calls + 2  # [160, 150, 90] and [20, 3]
    feats = batch.hidden
    singles = []
    for b, s in enumerate(seqs):
        one = ModelRunner(model)
        one.track_hidden()
        one.reset()
        torch.testing.assert_close(pre[b, :len(s)], one.forward(torch.tensor(s)),
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(feats[b, :len(s)], one.hidden, atol=1e-5, rtol=1e-5)
        singles.append(one)
    assert [batch.length(b) for b in range(6)] == [3] + [len(s) for s in seqs]
    got = batch.forward([torch.tensor([9])] * 6)
    for b, one in enumerate(singles):
        torch.testing.assert_close(got[b + 1, :1], one.forward(torch.tensor([9])),
                                   atol=1e-5, rtol=1e-5)

@pytest.mark.parametrize("draft", ["close", "weak"])
def test_every_method_in_a_batch_equals_each_row_alone(tiny_pair, draft):
    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair[draft])
    ps = prompts(9)
    accepted = 0
    for method, hp in SETTINGS + EXTRA:
        alone = [dec.generate(prompt_ids=p, method=method, max_new_tokens=24, **hp)
                 for p in ps]
        for batch_size in (4, 9):  # rows join as others finish / all at once
            res = dec.generate(prompts=ps, method=method, max_new_tokens=24,
                               batch_size=batch_size, **hp)
            assert [r.token_ids for r in res] == [a.token_ids for a in alone], (method, hp)
            assert [r.stats.accepted_lengths for r in res] == \
                [a.stats.accepted_lengths for a in alone], (method, hp)
            assert dec.last_batch.max_batch == batch_size
            accepted += sum(r.stats.accepted_tokens for r in res)
    if draft == "close":
        assert accepted > 300


def test_batched_drafters_draft_together(tiny_pair):
    """Chain, EAGLE-2 trees and optimal/SALF draft every row in shared forwards; other
    methods (no draft model, or feature drafters) fall back to one drafter per row."""
    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    ctx = BuildContext(dec.draft, SamplingParams(0.0))
    for name, knobs, kind in [("chain", {"gamma": 3}, BatchModelDrafter),
                              ("salf", {"nodes": 8, "batch": 2}, BatchModelDrafter),
                              ("tree", {"nodes": 6, "depth": 3}, BatchModelDrafter),
                              ("pld", {}, PerRowDrafters)]:
        cfg = parse_method({"name": name, **knobs})
        drafter = make_batch_drafter(cfg, ctx, lambda g, c=cfg: c.build(BuildContext(
            ModelRunner(dec.draft.model), SamplingParams(0.0), g)))
        assert isinstance(drafter, kind), name
    ps = prompts(8)
    dec.generate(prompts=ps, method="chain", gamma=3, max_new_tokens=20)
    batched = dec.last_batch
    rounds = max(len(r) for r in [dec.generate(prompt_ids=p, method="chain", gamma=3,
                                                max_new_tokens=20).stats.accepted_lengths
                                   for p in ps])
    # one target forward per round of the slowest row (+ the prefill), not per row
    assert batched.target_forwards == rounds + 1
    assert batched.draft_forwards <= 3 * rounds + 1


def test_rows_stop_at_eos_and_leave(tiny_pair):
    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    ps = prompts(6)
    full = [dec.generate(prompt_ids=p, method="ar", max_new_tokens=30).token_ids for p in ps]
    eos = dec.eos_token_id = full[0][5]
    for method in ("ar", "chain", "salf"):
        alone = [dec.generate(prompt_ids=p, method=method, max_new_tokens=30).token_ids
                 for p in ps]
        res = dec.generate(prompts=ps, method=method, max_new_tokens=30, batch_size=3)
        assert [r.token_ids for r in res] == alone
        assert res[0].token_ids[-1] == eos and len(res[0].token_ids) <= 6  # stopped at EOS
        assert len({len(r.token_ids) for r in res}) > 1  # rows left at different rounds


def test_sampling_rows_are_reproducible_per_row(tiny_pair):
    """Row i uses seed + i: with sampling, a batch gives each row what it gets alone."""
    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    ps = prompts(5)
    for method, hp in [("chain", {"gamma": 3}), ("salf", {"nodes": 6, "batch": 2})]:
        alone = [dec.generate(prompt_ids=p, method=method, max_new_tokens=16, temperature=0.9,
                              seed=7 + i, **hp).token_ids for i, p in enumerate(ps)]
        res = dec.generate(prompts=ps, method=method, max_new_tokens=16, temperature=0.9,
                           seed=7, batch_size=3, **hp)
        assert [r.token_ids for r in res] == alone, method


@pytest.mark.parametrize("kwargs,field", [
    ({"prompts": []}, "prompts"),
    ({"prompts": "def f("}, "prompts"),
    ({"prompts": [[1, 2], []]}, "prompt"),
    ({"prompts": [[1, 2], [True]]}, "prompts[1]"),
    ({"prompts": [[1, 2], [1, 999]]}, "prompt_ids"),
    ({"prompts": [[1, 2]], "batch_size": 0}, "batch_size"),
    ({"prompt_ids": [1, 2], "batch_size": 2}, "batch_size"),
    ({"prompts": [[1, 2]], "prompt_ids": [1]}, "prompts"),
])
def test_bad_batches_name_the_field(tiny_pair, kwargs, field):
    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    with pytest.raises(ValueError, match=rf"^{field.replace('[', '.').replace(']', '.')}"):
        dec.generate(method="chain", max_new_tokens=4, **kwargs)


def test_cli_decodes_several_prompts_as_one_batch(tiny_pair, capsys):
    from speclab.cli import main

    base = ["generate", "--target", tiny_pair["target"], "--draft", tiny_pair["close"],
            "--method", "chain", "--gamma", "3", "--max-new-tokens", "12", "--json"]
    assert main([*base, "--prompt-ids", "1,2,3", "--prompt-ids", "7", "--prompt-ids", "4,4",
                 "--batch-size", "2"]) == 0
    out = capsys.readouterr()
    rows = [json.loads(line) for line in out.out.splitlines()]
    assert [r["prompt_index"] for r in rows] == [0, 1, 2]
    assert "at most 2 at once" in out.err
    for ids, row in zip(["1,2,3", "7", "4,4"], rows):
        assert main([*base, "--prompt-ids", ids]) == 0
        assert json.loads(capsys.readouterr().out)["token_ids"] == row["token_ids"]


@pytest.mark.parametrize("compiled", [False, True])
def test_static_fast_path_equals_the_engine(tiny_pair, compiled):
    """The static cache (rows and capacity fixed; a small capacity forces in-place
    compaction), eager and compiled: every row still equals the row decoded alone."""
    from speclab.decoding.static_runner import FastPath, StaticBatchRunner

    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    fast = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"], compile=True,
                                   capacity=48)
    if not compiled:  # the same static layout without torch.compile
        fast.batch_runner = lambda model, rows, cap, *_: StaticBatchRunner(
            fast._fast.setdefault((id(model), rows, cap), FastPath(model, rows, cap, False)))
    ps = prompts(5)
    settings = [("ar", {}), ("chain", {"gamma": 3})] + (
        [] if compiled else [("salf", {"nodes": 8, "batch": 2}), ("pld", {})])
    for method, hp in settings:
        alone = [dec.generate(prompt_ids=p, method=method, max_new_tokens=20, **hp).token_ids
                 for p in ps]
        res = fast.generate(prompts=ps, method=method, max_new_tokens=20, batch_size=3, **hp)
        assert [r.token_ids for r in res] == alone, method
        one = fast.generate(prompt_ids=ps[0], method=method, max_new_tokens=20, **hp)
        assert one.token_ids == alone[0]
    assert (fast.warmup_s > 0) == compiled


def test_batch_bench_helpers():
    from speclab.bench import crossover, parse_batch_sizes

    assert parse_batch_sizes("16,1,4,4") == [1, 4, 16]
    for bad in ("", "a,b", "0,4"):
        with pytest.raises(ValueError, match="^batch_sizes"):
            parse_batch_sizes(bad)
    rows = [{"method": "ar", "batch_size": b, "speedup": 1.0} for b in (1, 4, 16)]
    rows += [{"method": "chain", "batch_size": b, "speedup": s}
             for b, s in ((1, 1.3), (4, 1.1), (16, 0.9))]
    rows += [{"method": "salf", "batch_size": b, "speedup": 1.2} for b in (1, 4, 16)]
    assert crossover(rows) == {"chain": 16, "salf": None}


def test_the_fast_path_keeps_one_static_cache_per_model_and_rows(tiny_pair, monkeypatch):
    """Prompts of many lengths: one static cache per (model, rows), replaced only when a
    call needs more capacity (the old one freed), reused when it needs less; outputs
    unchanged. (Before: one 4 GB-class cache and one compile per prompt length.)"""
    import functools

    import speclab.api as api
    from speclab.decoding.static_runner import FastPath

    monkeypatch.setattr(api, "FastPath", functools.partial(FastPath, compile=False))
    dec = Decoder.from_pretrained(tiny_pair["target"])
    fast = Decoder.from_pretrained(tiny_pair["target"], compile=True)
    for n in (5, 70, 10, 140, 20):
        ids = [(i % 60) + 2 for i in range(n)]
        want = dec.generate(prompt_ids=ids, method="ar", max_new_tokens=4).token_ids
        assert fast.generate(prompt_ids=ids, method="ar", max_new_tokens=4).token_ids == want
        assert len(fast._fast) == 1
    assert [f.capacity for f in fast._fast.values()] == [256]

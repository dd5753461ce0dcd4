"""The Serve replicas' engine (no Ray): requests as rows of one batched target and
batched drafters, joining and leaving at any round, verified in subsets; and the
batching clock and loopback channel the deployments use."""

import asyncio
import json
import os

import pytest
import torch

from serve_apps.batcher import StepBatcher
from serve_apps.channel import ChannelClient, ChannelError, ChannelServer
from speclab.api import Decoder
from speclab.config.method import parse_method
from speclab.decoding.batch_runner import BatchRunner
from speclab.decoding.loop import commit_tokens, eos_set
from speclab.decoding.row_pool import DraftPool, NewRow, TargetPool, seeded
from speclab.decoding.rules import RuleSpec
from speclab.decoding.runner import ModelRunner
from speclab.decoding.sampling import SamplingParams
from speclab.decoding.tree import TokenTree
from speclab.drafters.registry import BuildContext, build_drafter, make_batch_drafter

from .test_engine_greedy import prompts

CASES = [("chain", {"gamma": 3}), ("salf", {"nodes": 12, "batch": 3, "salf_threshold": 0.2}),
         ("tree", {"tree_top_k": 2, "depth": 3, "nodes": 6}), ("pld", {})]


def _pools(dec: Decoder, method: dict, **ahead) -> tuple[TargetPool, DraftPool]:
    cfg = parse_method(method)
    draft = dec.draft.model if dec.draft is not None else None

    def ctx(sampling, g):
        return BuildContext(ModelRunner(draft) if draft is not None else None, sampling, g, {})

    def make(sampling):
        return make_batch_drafter(cfg, ctx(sampling, None),
                                  lambda g: build_drafter(cfg, ctx(sampling, g)))

    return TargetPool(BatchRunner(dec.target.model)), DraftPool(make, **ahead)


@pytest.mark.parametrize("name,params", CASES)
def test_requests_joining_and_leaving_at_any_round_equal_decoding_alone(tiny_pair, name,
                                                                        params):
    """Six requests join at rounds 0, 0, 1, 3, 3, 5 and each round only every other
    ready request is verified (the rest wait, as on a replica whose batch closed
    without them); every request still gets exactly its tokens and accepted lengths."""
    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    method = {"name": name, **params}
    want = {}
    ps = prompts(6)
    for i, p in enumerate(ps):
        res = dec.generate(prompt_ids=p, method=name, max_new_tokens=20, **params)
        want[f"r{i}"] = (res.token_ids, res.stats.accepted_lengths)
    target, drafts = _pools(dec, method)
    joins = {0: ["r0", "r1"], 1: ["r2"], 3: ["r3", "r4"], 5: ["r5"]}
    live: dict[str, dict] = {}
    got: dict[str, tuple[list[int], list[int]]] = {}
    greedy = SamplingParams()
    for rnd in range(200):
        new = [NewRow(rid, ps[int(rid[1:])], greedy, RuleSpec("greedy"), seeded(0))
               for rid in joins.get(rnd, [])]
        if new:
            tops = target.start(new, 0)
            drafts.join([NewRow(r.rid, r.prompt_ids, greedy, None, seeded(1), t.top, t.features)
                         for r, t in zip(new, tops, strict=True)])
            for r in new:
                live[r.rid] = {"path": None, "new": [], "out": [], "lengths": []}
        ready = sorted(live)[rnd % 2::2] or sorted(live)
        if not ready:
            if rnd > 5:
                break
            continue
        items = [(rid, live[rid]["path"], live[rid]["new"], 20 - len(live[rid]["out"]) - 1,
                  None) for rid in ready]
        proposals = drafts.propose(items)
        verdicts = target.verify([(rid, p.tree.to_wire() if p.tree is not None else None)
                                  for rid, p in zip(ready, proposals, strict=True)])
        for rid, v in zip(ready, verdicts, strict=True):
            st = live[rid]
            st["path"], st["new"] = v.path, v.new
            n0 = len(st["out"])
            done = commit_tokens(st["out"], v.new, 20, eos_set(dec.eos_token_id))
            st["lengths"].append(len(st["out"]) - n0)
            if done:
                got[rid] = (st.pop("out"), st.pop("lengths"))
                del live[rid]
                assert target.end(rid) and drafts.end(rid)
    assert got == want
    assert len(target) == 0 and len(drafts) == 0 and not drafts.groups


@pytest.mark.parametrize("name,params", [CASES[0], CASES[1]])
def test_logprobs_are_the_targets_own_whatever_the_draft_and_the_batch(tiny_pair, name,
                                                                       params):
    """A row asking for logprobs (3 alternatives, echo) gets, per committed token, the
    target's log-softmax at the position that predicted it, and per prompt token the
    prefill's (None for the first), equal to one plain forward of the target over the
    whole sequence, however many drafts a round accepted and whoever shared the batch;
    a row that did not ask gets none."""
    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    target, drafts = _pools(dec, {"name": name, **params})
    ps = prompts(3)
    rows = [NewRow(f"r{i}", p, SamplingParams(), RuleSpec("greedy"), seeded(0),
                   logprobs=3 if i != 1 else None, echo=i == 0) for i, p in enumerate(ps)]
    started = target.start(rows)
    drafts.join(rows)
    assert started[1].prompt_logprobs is None and started[2].prompt_logprobs is None
    out = {r.rid: [] for r in rows}
    lps = {r.rid: [] for r in rows}
    path = {r.rid: None for r in rows}
    new = {r.rid: [] for r in rows}
    for _ in range(5):
        props = drafts.propose([(rid, path[rid], new[rid], 4, None) for rid in out])
        for rid, v in zip(out, target.verify([(rid, p.tree) for rid, p in zip(
                out, props, strict=True)]), strict=True):
            path[rid], new[rid] = v.path, v.new
            out[rid] += v.new
            assert (v.logprobs is None) == (rid == "r1")
            lps[rid] += v.logprobs or []
    assert max(len(v) for v in out.values()) > 5  # rounds accepted drafts
    for i in (0, 2):
        seq = ps[i] + out[f"r{i}"]
        with torch.no_grad():
            ref = torch.log_softmax(dec.target.model(torch.tensor([seq])).logits[0].float(), -1)
        want = ref[len(ps[i]) - 1:-1]
        got = lps[f"r{i}"]
        assert [e[0] for e in got] == out[f"r{i}"]
        torch.testing.assert_close(torch.tensor([e[1] for e in got]),
                                   want[torch.arange(len(got)), out[f"r{i}"]],
                                   atol=1e-4, rtol=0)
        for e, row in zip(got, want, strict=True):
            top = row.topk(3)
            assert [a[0] for a in e[2]] == top.indices.tolist()
            torch.testing.assert_close(torch.tensor([a[1] for a in e[2]]), top.values,
                                       atol=1e-4, rtol=0)
        if i == 0:
            echo = started[0].prompt_logprobs
            assert echo[0] is None and [e[0] for e in echo[1:]] == ps[0][1:]
            torch.testing.assert_close(
                torch.tensor([e[1] for e in echo[1:]]),
                ref[torch.arange(len(ps[0]) - 1), ps[0][1:]], atol=1e-4, rtol=0)


def test_pools_group_drafters_by_sampling_and_name_unknown_requests(tiny_pair):
    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    target, drafts = _pools(dec, {"name": "chain", "gamma": 2})
    hot = SamplingParams(temperature=0.8)
    rows = [NewRow("a", [1, 2, 3], SamplingParams(), RuleSpec("greedy"), seeded(0)),
            NewRow("b", [4, 5], hot, RuleSpec("sample"), seeded(0))]
    target.start(rows)
    drafts.join(rows)
    # a draft row's prompt waits for its first draft: a request decoded plainly costs none
    assert len(drafts.groups) == 2 and target.length("a") == 2 and drafts.length("b") == 0
    drafts.propose([("b", None, [], 0, None)])
    assert drafts.length("b") == 0
    drafts.propose([("b", None, [], 2, None)])  # prompt (1), root (1), the chain's first (1)
    assert drafts.length("b") == 3
    # rows wait at the end of the batch: one that drafts prefills the waiting rows up to
    # itself, not those after it
    trio = [NewRow(r, [1, 2, 3], SamplingParams(), RuleSpec("greedy"), seeded(0))
            for r in ("x", "y", "z")]
    drafts.join(trio)  # (into "a"'s group, after it)
    drafts.propose([("x", None, [], 0, None), ("y", None, [], 2, None),
                    ("z", None, [], 0, None)])
    assert [drafts.length(r) for r in ("a", "x", "y", "z")] == [2, 2, 4, 0]
    with pytest.raises(KeyError):
        target.verify([("nope", None)])
    with pytest.raises(KeyError):
        drafts.propose([("nope", None, [], 2, None)])
    target.start([NewRow("a", [7, 7, 7, 7], SamplingParams(), RuleSpec("greedy"), seeded(0))])
    assert len(target) == 2 and target.length("a") == 3  # the same id starts over
    assert drafts.end("b") and not drafts.end("b") and len(drafts.groups) == 1


def test_one_rows_failure_leaves_the_other_rows_of_the_batch_untouched(tiny_pair):
    """A row whose verification raises (here: a rule nobody registered) gets its own
    exception from the batched verify, its cache as before; the other rows' verdicts
    and later tokens equal a batch without it. A poisoned draft group fails alone."""
    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    ps = prompts(3)

    def run(poison: bool) -> dict:
        target, drafts = _pools(dec, {"name": "chain", "gamma": 3})
        rows = [NewRow(f"r{i}", p, SamplingParams(), RuleSpec("greedy"), seeded(0))
                for i, p in enumerate(ps)]
        if poison:
            rows.insert(1, NewRow("bad", ps[1], SamplingParams(),
                                  RuleSpec("no-such-rule"), seeded(0)))
        target.start(rows)
        drafts.join(rows)
        got = {r.rid: [] for r in rows}
        path = {r.rid: None for r in rows}
        new = {r.rid: [] for r in rows}
        for _ in range(4):
            rids = list(got)
            props = drafts.propose([(rid, path[rid], new[rid], 3, None) for rid in rids])
            before = target.length("bad") if poison else 0
            res = target.verify([(rid, p.tree) for rid, p in zip(rids, props, strict=True)])
            for rid, v in zip(rids, res, strict=True):
                if rid == "bad":
                    assert isinstance(v, ValueError) and "no-such-rule" in str(v)
                    assert target.length("bad") == before
                    continue
                path[rid], new[rid] = v.path, v.new
                got[rid] += v.new
        got.pop("bad", None)
        return got

    assert run(poison=True) == run(poison=False)
    bad_sampling = SamplingParams(temperature=0.5)
    target, drafts = _pools(dec, {"name": "chain", "gamma": 2})
    rows = [NewRow("a", ps[0], SamplingParams(), RuleSpec("greedy"), seeded(0)),
            NewRow("b", ps[1], bad_sampling, RuleSpec("sample"), seeded(0))]
    drafts.join(rows)
    group = drafts.groups[next(k for k in drafts.groups if "0.5" in k)]

    def boom(*args, **kwargs):
        raise RuntimeError("probability tensor contains either inf, nan or element < 0")

    group.drafter.propose = boom
    a, b = drafts.propose([("a", None, [], 2, None), ("b", None, [], 2, None)])
    assert a.tree is not None and isinstance(b, RuntimeError)


def _run(coro):
    return asyncio.run(coro)


def test_batcher_closes_a_batch_when_every_live_source_is_in_it():
    batches = []

    async def run(steps):
        batches.append(list(steps))
        return [s * 10 for s in steps]

    async def main():
        live = {"n": 1}
        b = StepBatcher(run, lambda: live["n"], max_batch=8, max_wait_s=5.0)
        t0 = asyncio.get_running_loop().time()
        assert await b.submit(1, "a") == 10  # one live source: no wait at all
        assert asyncio.get_running_loop().time() - t0 < 1.0
        live["n"] = 3
        res = await asyncio.gather(*(b.submit(i, f"s{i}") for i in range(3)))
        assert res == [0, 10, 20] and batches[-1] == [0, 1, 2]
        live["n"] = 4  # a straggler that never comes: the batch closes after max_wait_s
        b.max_wait_s = 0.05
        t0 = asyncio.get_running_loop().time()
        await asyncio.gather(*(b.submit(i, f"s{i}") for i in range(3)))
        assert asyncio.get_running_loop().time() - t0 >= 0.05 and batches[-1] == [0, 1, 2]

    _run(main())


def test_batcher_fails_only_the_steps_that_failed():
    async def run(steps):
        if 99 in steps:
            raise RuntimeError("model broke")
        return [ValueError(f"bad {s}") if s < 0 else s for s in steps]

    async def main():
        b = StepBatcher(run, lambda: 2, max_batch=8, max_wait_s=1.0)
        ok, bad = await asyncio.gather(b.submit(1, "a"), b.submit(-1, "b"),
                                       return_exceptions=True)
        assert ok == 1 and isinstance(bad, ValueError)
        res = await asyncio.gather(b.submit(99, "a"), b.submit(2, "b"), return_exceptions=True)
        assert all(isinstance(r, RuntimeError) for r in res)
        assert b.batches == 2 and b.steps == 4

    _run(main())


def test_channel_answers_only_callers_with_the_secret():
    async def handler(op, args):
        if op == "bad":
            raise ValueError("prompt_ids: out of range")
        if op == "boom":
            raise RuntimeError("replica broke")
        return {"op": op, "args": args, "tensor": torch.ones(2)}

    async def main():
        server = ChannelServer(handler)
        where = await server.address()
        client = ChannelClient(where["path"], where["secret"])
        reply = await client.call("verify_rows", "t0", [("a", None)])
        assert reply["args"] == ("t0", [("a", None)]) and reply["tensor"].sum() == 2
        with pytest.raises(ValueError, match="prompt_ids"):
            await client.call("bad")
        with pytest.raises(ChannelError, match="replica broke"):
            await client.call("boom")
        assert (await client.call("again"))["op"] == "again"  # the connection is reused
        assert os.stat(os.path.dirname(where["path"])).st_mode & 0o077 == 0  # owner only
        intruder = ChannelClient(where["path"], b"x" * 32)
        with pytest.raises(ChannelError, match="went away"):
            await intruder.call("verify_rows")  # dropped before anything is unpickled
        client.close()
        await server.close()
        assert not os.path.exists(where["path"])
        with pytest.raises(ChannelError):
            await ChannelClient(where["path"], where["secret"]).call("verify_rows")

    _run(main())


@pytest.mark.parametrize("name,params", CASES)
def test_drafting_ahead_while_the_target_verifies_changes_no_token(tiny_pair, name, params):
    """Each round, once the trees are "sent", the pool drafts the next round of every
    sent request on a guessed verdict (as the draft replica does while the target
    verifies): tokens stay exactly those of decoding alone, hits hand out trees without
    a draft forward, misses rewind and draft again; a drafter that cannot rewind (pld)
    drafts nothing ahead."""
    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    ps = prompts(3)
    want = {f"r{i}": dec.generate(prompt_ids=p, method=name, max_new_tokens=24,
                                  **params).token_ids for i, p in enumerate(ps)}
    # (a hit rate of 0 keeps it on: the random tiny pair agrees less than a trained one)
    target, drafts = _pools(dec, {"name": name, **params}, ahead_min_hit_rate=0.0)
    greedy = SamplingParams()
    new = [NewRow(f"r{i}", p, greedy, RuleSpec("greedy"), seeded(0)) for i, p in enumerate(ps)]
    tops = target.start(new, 0)
    drafts.join([NewRow(r.rid, r.prompt_ids, greedy, None, seeded(1), t.top, t.features)
                 for r, t in zip(new, tops, strict=True)])
    live = {r.rid: {"path": None, "new": [], "out": []} for r in new}
    got, flags = {}, []
    while live:
        ready = sorted(live)
        items = [(rid, live[rid]["path"], live[rid]["new"], 24 - len(live[rid]["out"]) - 1,
                  None) for rid in ready]
        calls = drafts.calls
        proposals = drafts.propose(items)
        if all(p.ahead for p in proposals):  # every tree was ready: no draft forward
            assert drafts.calls == calls
        flags += [p.ahead for p in proposals]
        wire = [(rid, p.tree.to_wire() if p.tree is not None else None)
                for rid, p in zip(ready, proposals, strict=True)]
        ahead = drafts.draft_ahead(ready)
        assert ahead == ([] if name == "pld" else [r for r in ready
                                                   if drafts.ahead_stats(r).plan()])
        for rid, v in zip(ready, target.verify(wire), strict=True):
            st = live[rid]
            st["path"], st["new"] = v.path, v.new
            if commit_tokens(st["out"], v.new, 24, eos_set(dec.eos_token_id)):
                got[rid] = st["out"]
                del live[rid]
                assert target.end(rid) and drafts.end(rid)
    assert got == want
    assert not drafts.ahead
    if name == "pld":
        assert set(flags) == {None}
    else:  # the close pair agrees often enough for both outcomes
        assert flags.count(True) > 0 and flags.count(False) > 0


def _close(a, b, tol: float = 1e-4) -> bool:
    """Nested lists of numbers equal up to ``tol`` (ints exactly)."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y, tol) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return abs(a - b) <= tol
    return a == b


def test_a_prompt_prefilled_in_chunks_gives_what_one_prefill_gives(tiny_pair):
    """Chunked prefill (Serve's ``serve.prefill_chunk``): rows whose prompts enter the
    cache a few tokens per step, beside rows prefilled whole, end with the same top
    tokens, features and prompt log-probs as one prefill, and then verify to the same
    tokens (greedy)."""
    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    ps = [p * 3 for p in prompts(3)]  # long enough for several chunks
    greedy = SamplingParams()

    def rows():
        return [NewRow(f"r{i}", p, greedy, RuleSpec("greedy"), seeded(0), logprobs=2,
                       echo=True) for i, p in enumerate(ps)]

    whole = TargetPool(BatchRunner(dec.target.model), features=True)
    want = whole.start(rows(), prefill_top_k=3)
    chunked = TargetPool(BatchRunner(dec.target.model), features=True)
    first = chunked.start(rows(), prefill_top_k=3, chunk=4)
    assert all(f is None for f in first) and set(chunked.prefilling) == {"r0", "r1", "r2"}
    got, steps = {}, 0
    while chunked.prefilling:
        got.update(chunked.prefill_step(budget=6, chunk=4))
        steps += 1
    assert steps >= max(len(p) for p in ps) // 6
    for i, w in enumerate(want):
        g = got[f"r{i}"]
        assert g.top == w.top
        assert torch.allclose(g.features, w.features, atol=1e-5)
        assert len(g.prompt_logprobs) == len(w.prompt_logprobs) == len(ps[i])
        flat = [json.loads(json.dumps(x)) for x in (g.prompt_logprobs, w.prompt_logprobs)]
        assert _close(*flat)
    a = whole.verify([(f"r{i}", None) for i in range(3)])
    b = chunked.verify([(f"r{i}", None) for i in range(3)])
    assert [r.new for r in a] == [r.new for r in b]
    with pytest.raises(ValueError, match="chunk"):
        chunked.start(rows()[:1], chunk=0)
    # rows that fit decode while a long one is prefilled apart; one that leaves mid-way
    # takes its staged cache with it
    pool = TargetPool(BatchRunner(dec.target.model))
    short = NewRow("s", prompts(1)[0][:3], greedy, RuleSpec("greedy"), seeded(0))
    assert pool.start([short, *rows()[:2]], chunk=5)[0] is not None
    out = []
    while pool.prefilling:
        out.append(pool.verify([("s", None)])[0].new)
        if "r1" in pool.prefilling and len(out) == 2:
            assert pool.end("r1") and "r1" not in pool.prefilling
        pool.prefill_step(budget=5)
    alone = TargetPool(BatchRunner(dec.target.model))
    alone.start([NewRow("s", prompts(1)[0][:3], greedy, RuleSpec("greedy"), seeded(0))])
    assert out == [alone.verify([("s", None)])[0].new for _ in out]
    assert pool.rids == ["s", "r0"] and pool.verify([("r0", None)])[0].new == b[0].new


def test_a_short_prompt_rides_in_the_verify_forward_and_gets_what_its_own_prefill_gives(
        tiny_pair):
    """``TargetPool.start(ride=True)`` (a Serve target replica joining rows while its
    batch verifies others): prompts no longer than the verify forward's widest tree are
    prefilled inside that forward as rows of their own, the longer ones in one forward
    before it. Each gets the top tokens, features and prompt log-probs its own prefill
    gives, the verified rows the same verdicts, and the riders then decode as rows
    prefilled alone; a riding row can leave before it boards, and ``settle`` prefills
    the riders when no verify forward comes."""
    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    greedy = SamplingParams()

    def row(rid, p):
        return NewRow(rid, p, greedy, RuleSpec("greedy"), seeded(0), logprobs=2, echo=True)

    base = {"b0": prompts(2)[0] + [3, 4], "b1": prompts(2)[1] + [5]}
    joins = {"j0": [5, 6, 7], "j1": [9, 3, 2, 8, 1], "j2": list(range(1, 20))}  # 2, 4, 18
    ref = TargetPool(BatchRunner(dec.target.model), features=True)
    pool = TargetPool(BatchRunner(dec.target.model), features=True)
    for p in (ref, pool):
        p.start([row(rid, q) for rid, q in base.items()], prefill_top_k=3)
    want = {rid: ref.start([row(rid, q)], prefill_top_k=3)[0] for rid, q in joins.items()}
    assert pool.start([row(rid, q) for rid, q in joins.items()], prefill_top_k=3,
                      ride=True) == [None] * 3
    assert [st.row.rid for st in pool.riding] == list(joins) and "j0" not in pool

    def chains(p):  # 5 tokens wide: j0 and j1 fit, j2 does not
        return [(rid, TokenTree.chain(p.roots[p.rids.index(rid)], [1, 2, 3, 4]).to_wire())
                for rid in base]

    calls = pool.runner.calls
    got = pool.verify(chains(pool))
    assert pool.runner.calls == calls + 2  # j2's own prefill, then the verify forward
    assert [r.new for r in got] == [r.new for r in ref.verify(chains(ref))]
    ridden = pool.take_ridden()
    assert set(ridden) == set(joins) and pool.take_ridden() == {} and not pool.riding
    for rid, w in want.items():
        g = ridden[rid]
        assert g.top == w.top
        assert torch.allclose(g.features, w.features, atol=1e-5)
        flat = [json.loads(json.dumps(x)) for x in (g.prompt_logprobs, w.prompt_logprobs)]
        assert _close(*flat)
    for _ in range(3):  # the riders decode on as rows prefilled alone
        assert ([r.new for r in pool.verify([(rid, None) for rid in joins])]
                == [r.new for r in ref.verify([(rid, None) for rid in joins])])
    pool.start([row("k", [4, 4]), row("m", [1, 2, 3])], ride=True)
    assert pool.end("k") and not pool.end("k") and "k" not in pool
    pool.settle()  # no verify forward came: m is prefilled alone
    assert set(pool.take_ridden()) == {"m"} and "m" in pool and not pool.riding
    # a runner's empty rows take their prompts in the next forward, with or without a cache
    for rows_first in (0, 2):
        a, b = BatchRunner(dec.target.model), BatchRunner(dec.target.model)
        for r in (a, b):
            r.add_rows([[1, 2, 3], [4, 5]][:rows_first])
        want_logits = a.add_rows([[7, 8, 9, 10]])
        b.add_empty_rows(1)
        assert b.rows == rows_first + 1 and b.length(rows_first) == 0
        got_logits = b.forward([torch.zeros(0, dtype=torch.long)] * rows_first
                               + [torch.tensor([7, 8, 9, 10])])
        assert torch.allclose(got_logits[rows_first], want_logits[0], atol=1e-5)
        assert b.length(rows_first) == 4


def test_a_replica_calls_cancellation_is_a_failure_and_the_callers_own_stays_one():
    """A CancelledError that a batch's replica call raised (Ray Serve's form of a dead
    replica's TaskCancelledError) fails that batch's steps with a RuntimeError and the
    batcher serves the next batch; the caller's own cancellation stays a cancellation."""
    from serve_apps.errors import as_failure, downstream_cancel

    async def run(steps):
        if 99 in steps:
            raise asyncio.CancelledError  # as `await handle.remote()` does
        return [asyncio.CancelledError() if s < 0 else s for s in steps]

    async def main():
        b = StepBatcher(run, lambda: 2, max_batch=8, max_wait_s=1.0)
        res = await asyncio.wait_for(asyncio.gather(  # never answered before: a hang
            b.submit(99, "a"), b.submit(2, "b"), return_exceptions=True), 30)
        assert all(type(r) is RuntimeError and "cancelled" in str(r) for r in res), res
        ok, bad = await asyncio.gather(b.submit(1, "a"), b.submit(-1, "b"),
                                       return_exceptions=True)
        assert ok == 1 and type(bad) is RuntimeError  # one step's entry, that step only
        assert downstream_cancel(asyncio.CancelledError())  # nobody cancelled this task
        assert not downstream_cancel(RuntimeError("x"))
        exc = ValueError("bad")
        assert as_failure(exc, "x") is exc

        async def cancelled_from_outside():
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError as exc:
                return downstream_cancel(exc)

        task = asyncio.create_task(cancelled_from_outside())
        await asyncio.sleep(0)
        task.cancel()
        assert await task is False  # a cancelled caller: stays a cancellation

    _run(main())

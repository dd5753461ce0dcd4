"""Pieces of the Serve app that need no Ray: the bounded per-request state store, the
draft tree's wire form, and the HTTP request validation."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from serve_apps.protocol import CompletionRequest, GenerateRequest, RecommendRequest
from serve_apps.sessions import SessionGone, SessionStore
from speclab.decoding.tree import DETERMINISTIC, SAMPLED, TokenTree


class FakeState:
    def __init__(self, tokens: int) -> None:
        self.tokens, self.released = tokens, False

    def cached_tokens(self) -> int:
        return self.tokens

    def release(self) -> None:
        self.released = True


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_idle_states_expire_and_are_released():
    clock = Clock()
    store = SessionStore(10, 1000, idle_timeout_s=5.0, clock=clock)
    a, b = FakeState(3), FakeState(4)
    store.put("a", a)
    clock.t = 3.0
    store.put("b", b)
    clock.t = 6.0  # a idle 6 s, b idle 3 s
    assert store.get("b") is b
    assert a.released and not b.released and store.expired == 1
    with pytest.raises(SessionGone, match="request a: no state .*idle more than 5s"):
        store.get("a")
    assert len(store) == 1 and store.cached_tokens() == 4


def test_bounds_evict_the_least_recently_used_other_state():
    store = SessionStore(max_sessions=2, max_cached_tokens=10, idle_timeout_s=100.0,
                         clock=Clock())
    s = {k: FakeState(n) for k, n in (("a", 2), ("b", 3), ("c", 4), ("d", 7))}
    store.put("a", s["a"])
    store.put("b", s["b"])
    store.get("a")  # a is now more recent than b
    store.put("c", s["c"])  # 3 states > 2: b goes
    assert s["b"].released and not s["a"].released and len(store) == 2
    store.put("d", s["d"])  # 3 states: a goes; 4 + 7 tokens > 10: c goes too
    assert s["a"].released and s["c"].released and not s["d"].released
    assert store.evicted == 3 and len(store) == 1
    assert store.end("d") and s["d"].released and not store.end("d")


def test_a_lone_state_above_the_token_bound_is_kept():
    store = SessionStore(4, max_cached_tokens=5, idle_timeout_s=100.0, clock=Clock())
    big = FakeState(50)
    store.put("big", big)  # evicting the new request itself would help nobody
    assert store.get("big") is big


def test_tree_wire_round_trip_keeps_what_verification_reads():
    tree = TokenTree(7)
    a = tree.add(3, 0, 0.6)
    tree.add(5, 0, 0.3)
    tree.add(9, a, 0.5, relaxed=True)
    q = torch.tensor([0.1, 0.2, 0.7])
    tree.set_children_kind(0, SAMPLED, q)
    tree.set_children_kind(a, DETERMINISTIC)
    back = TokenTree.from_wire(tree.to_wire())
    assert back.tokens == tree.tokens and back.parents == tree.parents
    assert back.q_prob == pytest.approx(tree.q_prob) and back.relaxed == tree.relaxed
    assert back.child_kind == tree.child_kind
    torch.testing.assert_close(back.q_dist[0], q)
    assert back.depths == tree.depths and back.children == tree.children


def test_malformed_wire_tree_is_a_clear_error():
    with pytest.raises(ValueError, match="tokens/parents"):
        TokenTree.from_wire({"tokens": [1, 2], "parents": [-1], "q_prob": [1, 1],
                             "relaxed": [False, False], "child_kind": {}, "q_dist": {}})


@pytest.mark.parametrize("body,field", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x", "stop": ["a"] * 5}, "stop"),
    ({"prompt": "x", "frobnicate": 1}, "frobnicate"),
    ({}, "prompt"),
])
def test_completion_request_errors_name_the_field(body, field):
    with pytest.raises(ValidationError) as err:
        CompletionRequest(**body)
    assert field in {str(p) for e in err.value.errors() for p in e["loc"]}


@pytest.mark.parametrize("prompt,words", [
    (["a", "b"], "one prompt per request (got a list of 2)"),
    ([[1], [2]], "one prompt per request"),
    ([3, -2], "token ids must be >= 0 (got -2 at index 1)"),
    ([["x"]], "a list of one of them"),
    (7, "must be a string or a list of token ids, got int"),
    ([], "must not be empty"),
])
def test_prompt_errors_say_their_cause(prompt, words):
    with pytest.raises(ValidationError) as err:
        CompletionRequest(prompt=prompt)
    (e,) = err.value.errors()
    assert words in e["msg"] and e["loc"] == ("prompt",)
    assert CompletionRequest(prompt=[[4, 5]]).prompt == [4, 5]


def test_request_defaults():
    c = CompletionRequest(prompt=["only one"], stop="\n")
    assert c.prompt == "only one" and c.stop == ["\n"] and c.temperature == 1.0
    g = GenerateRequest(prompt_ids=[1, 2])
    assert g.stop == [] and g.temperature == 0.0
    with pytest.raises(ValidationError):
        GenerateRequest(prompt_ids=[])
    with pytest.raises(ValidationError):
        RecommendRequest(history=[])


def test_a_deadline_is_told_from_a_replicas_own_timeout():
    """``_before``: a step slower than the deadline raises _DeadlinePassed; a step that
    itself raises TimeoutError (a replica's error) before the deadline stays that error;
    no deadline waits."""
    import asyncio
    import time

    from serve_apps.ingress import _before, _DeadlinePassed

    async def slow():
        await asyncio.sleep(5)

    async def broken():
        raise TimeoutError("the replica's own")

    async def fine():
        return 7

    with pytest.raises(_DeadlinePassed):
        asyncio.run(_before(slow(), time.perf_counter() + 0.05))
    with pytest.raises(TimeoutError, match="the replica's own"):
        asyncio.run(_before(broken(), time.perf_counter() + 60))
    assert asyncio.run(_before(fine(), None)) == 7


def test_the_serve_benchs_eagle_row_uses_the_benchs_tree():
    """``serve_apps.bench``'s EAGLE row runs the tree ``speclab bench`` gives its EAGLE
    rows (the method's defaults ranked untuned: 1.13x against 1.26x through Serve), with
    the drafter given; a row without one is refused naming the flag."""
    from serve_apps.bench import bench_method
    from speclab.bench import EAGLE_RUN
    from speclab.config import ServeJob

    cfg = ServeJob.model_validate({"name": "t", "models": {"target": "t", "draft": "d"}})
    row = bench_method(cfg, "eagle", eagle_model="models:/e/1")
    assert row == {"name": "eagle", "eagle_model": "models:/e/1", **EAGLE_RUN}
    assert bench_method(cfg, "medusa", medusa_model="m") == {"name": "medusa",
                                                             "medusa_model": "m"}
    with pytest.raises(ValueError, match="--eagle-model"):
        bench_method(cfg, "eagle")
    assert bench_method(cfg, cfg.method.name) == cfg.method.model_dump(mode="json")

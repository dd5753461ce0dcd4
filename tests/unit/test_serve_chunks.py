"""How a replica sends a request's rounds to the ingress (``serve_apps.decode.
stream_rounds``): a chunk per round, or, with ``hold_s``, the rounds of each ``hold_s``
seconds as one chunk. Either way the ingress rebuilds the same tokens, logprobs and
per-round statistics (a colocated replica in process, chain drafting on the tiny pair)."""

from __future__ import annotations

import asyncio

import pytest

from serve_apps.colocated import ColocatedDeployment
from serve_apps.decode import DecodeRequest, LiveStats
from speclab.decoding.rules import RuleSpec


@pytest.fixture(scope="module")
def replica(tiny_pair):
    return ColocatedDeployment(tiny_pair["target"], tiny_pair["close"],
                               {"name": "chain", "gamma": 3}, 64, batch_wait_ms=0.0)


def _chunks(replica, rid: str, hold_s: float, logprobs: int | None = None) -> list[dict]:
    req = DecodeRequest([3, 9, 27, 5], 20, {"temperature": 0.0}, RuleSpec("greedy").to_dict(),
                        0, [], logprobs=logprobs, hold_s=hold_s)

    async def run():
        return [c async for c in replica.generate(rid, req.__dict__)]

    return asyncio.run(run())


@pytest.mark.parametrize("logprobs", [None, 2])
def test_held_rounds_arrive_as_one_chunk_with_the_same_content(replica, logprobs):
    each = _chunks(replica, "a", 0.0, logprobs)
    held = _chunks(replica, "b", 60.0, logprobs)
    stats = each[-1]["stats"]
    assert held[-1]["stats"]["accepted_lengths"] == stats["accepted_lengths"]
    rounds = len(stats["accepted_lengths"])
    assert rounds > 2 and len(each) == rounds + 1  # a chunk per round, then the stats
    assert len(held) == 2  # every round in one chunk, then the stats
    tokens = [t for c in each[:-1] for t in c["tokens"]]
    assert held[0]["tokens"] == tokens and len(tokens) == 20
    if logprobs is None:
        assert all("logprobs" not in c for c in each + held)
    else:
        assert held[0]["logprobs"] == [x for c in each[:-1] for x in c["logprobs"]]
        assert len(held[0]["logprobs"]) == 20
    # the ingress's running copy of the statistics comes out the same either way
    for chunks in (each, held):
        live = LiveStats()
        for c in chunks[:-1]:
            live.add(c["progress"])
        for key in ("accepted_lengths", "round_accepted", "round_drafted"):
            assert getattr(live.stats, key) == stats[key], key
        assert live.stats.target_calls == stats["target_calls"]


def test_a_hold_shorter_than_a_round_sends_every_round(replica):
    """A chunk goes out once ``hold_s`` has passed since the last one: with a hold far
    below a round's time that is every round, as without a hold."""
    chunks = _chunks(replica, "c", 1e-9)
    assert len(chunks) == len(chunks[-1]["stats"]["accepted_lengths"]) + 1

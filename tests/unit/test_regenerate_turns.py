"""Regeneration's turn logic on a tiny ChatML LLaMA (256 positions): prompts are the
conversation so far with the target's own answers, a turn too long for the context is
not answered (its conversation ends before it; one with no answered turn is left out)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from speclab.config.method import parse_method
from speclab.data.conversations import Conversation
from speclab.pipelines.regenerate import answer_shard, user_turns
from tests.gguf_fixture import tiny_chat_llama


@pytest.fixture(scope="module")
def dec(tmp_path_factory):
    from speclab.api import Decoder

    return Decoder.from_pretrained(str(tiny_chat_llama(tmp_path_factory.mktemp("m"))))


def _cfg(new: int = 6):
    return SimpleNamespace(regenerate=SimpleNamespace(
        turns=2, max_new_tokens=new, batch_size=4, temperature=0.0, top_p=1.0,
        method=parse_method({"name": "ar"})))


def test_user_turns_keep_system_and_drop_assistant_messages():
    conv = Conversation("c", [{"role": "system", "content": "S"},
                              {"role": "user", "content": "U1"},
                              {"role": "assistant", "content": "A1"},
                              {"role": "user", "content": "U2"},
                              {"role": "user", "content": "U3"}])
    assert user_turns(conv, 2) == [
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"}],
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
         {"role": "user", "content": "U2"}]]


def test_turns_too_long_for_the_context_are_not_answered(dec):
    long = " ".join(f"q{i}z" for i in range(200))  # far more than the 256 positions
    records = [
        {"id": "ok", "messages": [{"role": "user", "content": "Hi"},
                                  {"role": "assistant", "content": "x"},
                                  {"role": "user", "content": "More?"}]},
        {"id": "second-too-long", "messages": [{"role": "user", "content": "Hi"},
                                               {"role": "assistant", "content": "x"},
                                               {"role": "user", "content": long}]},
        {"id": "first-too-long", "messages": [{"role": "user", "content": long}]},
    ]
    out, totals = answer_shard(dec, records, _cfg(), None, 0)
    assert [r["id"] for r in out] == ["ok", "second-too-long"]
    assert [m["role"] for m in out[0]["messages"]] == ["user", "assistant"] * 2
    assert [m["role"] for m in out[1]["messages"]] == ["user", "assistant"]
    assert out[0]["messages"][1] == out[1]["messages"][1]  # the same first turn, greedy
    assert totals["too_long"] == 2 and totals["answers"] == 3
    assert totals["new_tokens"] == sum(sum(r["regenerated"]["new_tokens"]) for r in out)


@pytest.mark.parametrize("order", ["length", "source"])
def test_shards_hold_conversations_of_like_length_or_the_source_order(order):
    """``regenerate.order: length`` cuts the shards from the conversations sorted by the
    characters of their first user turn (a batch of like-length prompts); ``source``
    keeps the order read; either way every conversation is in exactly one shard and the
    setting is part of what a rerun must match."""
    from speclab.config.jobs import RegenerateJob
    from speclab.pipelines.regenerate import first_turn_size, plan, settings_of

    cfg = RegenerateJob.from_yaml("experiments/smoke/regenerate.yaml",
                                  [f"regenerate.order={order}"])
    shards, read = plan(cfg)
    ids = [x["id"] for s in shards for x in s]
    first = [first_turn_size(x) for s in shards for x in s]
    assert len(ids) == read["conversations"] == 8 and len(set(ids)) == 8
    if order == "length":
        assert first == sorted(first) and ids != sorted(ids)
    else:
        assert ids == sorted(ids)  # the smoke file lists smoke-00, smoke-01, ...
    assert settings_of(cfg, "t")["order"] == order

"""Conversations as training data: every accepted format, a truncated file, malformed
records, a conversation without an assistant turn, a tokenizer without a chat template,
the assistant-only loss mask and the deterministic split (tiny fixtures; no download)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from speclab.data.conversations import (
    ConversationError,
    ReadStats,
    read_conversations,
    render,
    split_of,
    windows,
)
from tests.gguf_fixture import CHATML, tiny_chat_llama

SHAREGPT = [
    {"id": "a", "conversations": [{"from": "human", "value": "Hi there"},
                                  {"from": "gpt", "value": "Hello! How can I help?"},
                                  {"from": "human", "value": "Reverse abc"},
                                  {"from": "gpt", "value": "cba"}]},
    {"id": "b", "conversations": [{"from": "system", "value": "Be brief."},
                                  {"from": "human", "value": "2+2?"},
                                  {"from": "chatgpt", "value": "4"}]},
    {"id": "c", "conversations": [{"from": "human", "value": "nobody answers"}]},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_chat_llama(tmp_path_factory.mktemp("tok")))


def _read(path, **kw) -> tuple[list, ReadStats]:
    stats = ReadStats()
    return list(read_conversations(path, stats=stats, **kw)), stats


def test_every_format_reads_the_same_conversations(tmp_path):
    as_json = tmp_path / "share.json"
    as_json.write_text(json.dumps(SHAREGPT, indent=1))
    as_jsonl = tmp_path / "share.jsonl"
    as_jsonl.write_text("\n".join(json.dumps(r) for r in SHAREGPT) + "\n\n")
    openai = tmp_path / "openai.jsonl"
    roles = {"human": "user", "gpt": "assistant", "chatgpt": "assistant", "system": "system"}
    openai.write_text("\n".join(json.dumps({"id": r["id"], "messages": [
        {"role": roles[t["from"]], "content": t["value"]} for t in r["conversations"]]})
        for r in SHAREGPT))
    results = [_read(p) for p in (as_json, as_jsonl, openai)]
    for convs, stats in results:
        assert [c.id for c in convs] == ["a", "b"]
        assert convs[1].messages[0] == {"role": "system", "content": "Be brief."}
        assert convs[1].messages[2] == {"role": "assistant", "content": "4"}
        assert (stats.conversations, stats.no_assistant, stats.malformed) == (2, 1, 0)
        assert not stats.truncated
    assert results[0][0][0].messages == results[2][0][0].messages


def test_a_truncated_json_list_yields_its_complete_records(tmp_path):
    text = json.dumps(SHAREGPT[:2])
    cut = tmp_path / "cut.json"
    cut.write_text(text[: text.index('"b"') + 30])  # inside the second record
    convs, stats = _read(cut)
    assert [c.id for c in convs] == ["a"] and stats.truncated
    assert "truncated" in stats.summary()
    with pytest.raises(ConversationError, match="record 2: truncated"):
        _read(cut, strict=True)
    small = tmp_path / "small.json"  # chunk boundaries inside records do not matter
    small.write_text(json.dumps(SHAREGPT))
    from speclab.data.conversations import _json_list

    records = [r for r, _ in _json_list(small, ReadStats(), False, chunk=7)]
    assert [r["id"] for r in records] == ["a", "b", "c"]


def test_malformed_records_are_skipped_and_counted_or_refused_with_their_line(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join([json.dumps(SHAREGPT[0]), "{not json", json.dumps({"x": 1}),
                               json.dumps({"conversations": [{"from": "alien",
                                                              "value": "?"}]}),
                               json.dumps(SHAREGPT[1])]))
    convs, stats = _read(path)
    assert [c.id for c in convs] == ["a", "b"] and stats.malformed == 3
    assert "line 2: not JSON" in stats.reasons[0] and "line 4: turn 0" in stats.reasons[2]
    with pytest.raises(ConversationError, match="mixed.jsonl: line 2: not JSON"):
        _read(path, strict=True)
    with pytest.raises(ConversationError, match="corpus.path: .*does not exist"):
        _read(tmp_path / "nope.json")
    with pytest.raises(ConversationError, match="corpus.format: unknown format"):
        _read(path, fmt="csv")


def test_render_masks_assistant_turns_only(tokenizer):
    conv = next(read_conversations_from(SHAREGPT[:1]))
    ids, mask = render(tokenizer, conv)
    assert len(ids) == len(mask) and 0 < sum(mask) < len(ids)
    spans, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    texts = [tokenizer.decode(s) for s in spans]
    assert texts == ["Hello! How can I help?<|im_end|>\n", "cba<|im_end|>\n"]
    full = tokenizer.apply_chat_template(conv.messages, tokenize=True)
    assert ids == list(full["input_ids"] if hasattr(full, "keys") else full)
    for w, m in windows(ids, mask, 8):  # windows of one conversation, each with a label
        assert len(w) <= 8 and any(m)


def test_a_tokenizer_without_a_chat_template_is_refused_unless_one_is_given(tokenizer):
    conv = next(read_conversations_from(SHAREGPT[:1]))
    bare = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    bare.chat_template = None
    with pytest.raises(ValueError, match="corpus.chat_template: .*no chat template"):
        render(bare, conv)
    assert render(bare, conv, template=CHATML) == render(tokenizer, conv)


def test_the_split_is_deterministic_and_by_conversation():
    ids = [f"conv-{i}" for i in range(2000)]
    first = [split_of(i, 0.1, 0.1, seed=3) for i in ids]
    assert first == [split_of(i, 0.1, 0.1, seed=3) for i in ids]
    share = {s: first.count(s) / len(ids) for s in ("train", "validation", "test")}
    assert 0.07 < share["validation"] < 0.13 and 0.07 < share["test"] < 0.13
    assert first != [split_of(i, 0.1, 0.1, seed=4) for i in ids]


def read_conversations_from(records: list[dict]):
    """Conversations of in-memory records (through the same record parser)."""
    from speclab.data.conversations import to_conversation

    return (to_conversation(r, f"record {i}") for i, r in enumerate(records, start=1))


def test_sharegpt_is_a_builtin_name(monkeypatch, tmp_path):
    """``sharegpt`` reads the registry package's file (here a stand-in: no download)."""
    from speclab.data import conversations

    fake = tmp_path / "ShareGPT_V3_unfiltered_cleaned_split.json"
    fake.write_text(json.dumps(SHAREGPT)[:-20])  # truncated, like the package's file
    monkeypatch.setattr(conversations, "sharegpt_file", lambda: fake)
    convs, stats = _read("sharegpt")
    assert [c.id for c in convs] == ["a", "b"] and stats.truncated
    assert Path(fake).exists()

"""Evaluation prompts of the kind users report: MT-bench / Spec-Bench question.jsonl,
held-out conversations (one and two turns, the second after the target's own answer),
prompt JSONL with categories, through the chat template (tiny fixtures)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from speclab.config.schema import DataConfig
from speclab.data.conversations import split_of
from speclab.data.prompts import Prompts, chat_prompts, jsonl_records
from tests.gguf_fixture import tiny_chat_llama

QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now shorter."]},
    {"question_id": 82, "category": "coding", "turns": ["Reverse a string in Python."]},
    {"question_id": 83, "category": "writing", "turns": ["Describe Lisbon.", "In French."]},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_chat_llama(tmp_path_factory.mktemp("tok")))


def _render(tok, messages):
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_questions_one_and_two_turns(tokenizer, tmp_path):
    path = tmp_path / "question.jsonl"
    path.write_text("\n".join(json.dumps(q) for q in QUESTIONS))
    one = chat_prompts(DataConfig(prompts="questions", path=str(path)), tokenizer)
    assert isinstance(one, Prompts) and one.categories == ["writing", "coding", "writing"]
    assert one[1] == _render(tokenizer, [{"role": "user", "content": QUESTIONS[1]["turns"][0]}])

    seen = []

    def answer(ids):
        seen.append(ids)
        return f"answer {len(seen)}"

    two = chat_prompts(DataConfig(prompts="questions", path=str(path), turns=2), tokenizer,
                       answer)
    assert two.categories == ["writing", "writing", "coding", "writing", "writing"]
    assert seen == [one[0], one[2]]  # the target answered each first turn that has a second
    assert two[1] == _render(tokenizer, [
        {"role": "user", "content": "Write a haiku."},
        {"role": "assistant", "content": "answer 1"},
        {"role": "user", "content": "Now shorter."}])
    with pytest.raises(ValueError, match="data.turns"):
        chat_prompts(DataConfig(prompts="questions", path=str(path), turns=2), tokenizer)
    assert len(chat_prompts(DataConfig(prompts="questions", path=str(path), num_prompts=2),
                            tokenizer)) == 2


def test_bad_question_files_name_the_line(tokenizer, tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps(QUESTIONS[0]) + "\n" + json.dumps({"question_id": 2}) + "\n")
    with pytest.raises(ValueError, match=r"q.jsonl:2 needs 'turns'"):
        chat_prompts(DataConfig(prompts="questions", path=str(path)), tokenizer)


def test_held_out_conversations_are_the_test_split(tokenizer, tmp_path):
    convs = [{"id": f"c{i}", "conversations": [
        {"from": "system", "value": "Be brief."}, {"from": "human", "value": f"Q{i}"},
        {"from": "gpt", "value": "A"}, {"from": "human", "value": "more"},
        {"from": "gpt", "value": "B"}]} for i in range(400)]
    path = tmp_path / "share.json"
    path.write_text(json.dumps(convs))
    test_ids = [c["id"] for c in convs if split_of(c["id"]) == "test"]
    assert test_ids  # about 2% of 400
    got = chat_prompts(DataConfig(prompts="conversations", path=str(path), num_prompts=50),
                       tokenizer)
    assert len(got) == len(test_ids) and set(got.categories) == {"conversations"}
    first = int(test_ids[0][1:])
    assert got[0] == _render(tokenizer, [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": f"Q{first}"}])


def test_prompt_jsonl_with_categories_and_chat(tokenizer, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "2+2?", "category": "math"}\n{"prompt": "hi"}\n')
    assert jsonl_records(str(path), 10) == [("math", "2+2?"), ("all", "hi")]
    got = chat_prompts(DataConfig(prompts="jsonl", path=str(path), chat=True), tokenizer)
    assert got.categories == ["math", "all"]
    assert got[0] == _render(tokenizer, [{"role": "user", "content": "2+2?"}])


def test_a_target_without_a_chat_template_is_refused_unless_one_is_given(tokenizer, tmp_path):
    path = tmp_path / "question.jsonl"
    path.write_text(json.dumps(QUESTIONS[1]))
    bare = SimpleNamespace(chat_template=None,
                           apply_chat_template=tokenizer.apply_chat_template)
    with pytest.raises(ValueError, match="data.chat_template"):
        chat_prompts(DataConfig(prompts="questions", path=str(path)), bare)
    given = DataConfig(prompts="questions", path=str(path),
                       chat_template=tokenizer.chat_template)
    assert chat_prompts(given, bare)[0] == _render(tokenizer, [
        {"role": "user", "content": QUESTIONS[1]["turns"][0]}])


def test_the_chat_kinds_need_a_path():
    with pytest.raises(ValueError, match="path is required when prompts is 'questions'"):
        DataConfig(prompts="questions")


def test_bench_prompt_file_per_category(tmp_path):
    """``speclab bench --prompt-file``: a question.jsonl's first turns (or prompt JSONL),
    grouped by category, through the target's chat template; a table per category whose
    counters add up to the whole set's; a line with neither field is refused by line."""
    from speclab.api import Decoder
    from speclab.bench import bench_prompts, by_category, result_rows
    from speclab.evaluation import MethodRun, merge_results

    target = tiny_chat_llama(tmp_path / "target", seed=0)
    draft = tiny_chat_llama(tmp_path / "draft", seed=1)
    dec = Decoder.from_pretrained(str(target), str(draft), "float32")
    path = tmp_path / "question.jsonl"
    path.write_text("\n".join(json.dumps(q) for q in QUESTIONS))
    prompts = bench_prompts(dec, 16, str(path))
    assert prompts.categories == ["writing", "writing", "coding"]  # grouped, first-seen order
    assert prompts[2] == _render(dec.tokenizer, [{"role": "user", "content":
                                                  "Reverse a string in Python."}])
    parts = by_category(dec, [MethodRun("chain", {"gamma": 2})], prompts,
                        {"max_new_tokens": 6, "timing_passes": 2})
    assert list(parts) == ["writing", "coding"]
    rows = result_rows(dec, prompts, merge_results(list(parts.values())))
    cats = {c: result_rows(dec, [p for p, k in zip(prompts, prompts.categories) if k == c],
                           part) for c, part in parts.items()}
    for i, row in enumerate(rows):
        assert row["new_tokens"] == sum(c[i]["new_tokens"] for c in cats.values())
        assert row["prompts"] == sum(c[i]["prompts"] for c in cats.values())
    assert rows[1]["identical_to_ar"] is True  # chain is exact at T=0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hi"}\n{"question": "no turns"}\n')
    with pytest.raises(ValueError, match=r"--prompt-file: .*bad.jsonl:2 needs"):
        bench_prompts(dec, 16, str(bad))

"""The evaluate job on chat prompts as a user runs it (``python -m jobs.evaluate --config
experiments/smoke/evaluate.yaml data.prompts=questions ...``): MT-bench-style questions
with categories and second turns, rendered with the target's chat template, give a
table per category beside the overall one, in the console, MLflow metrics and
``categories.json``; the categories' figures add up to the whole."""

from __future__ import annotations

import json

import pytest

from tests.gguf_fixture import tiny_chat_llama
from tests.integration.conftest import find_run, python, run_cmd

pytestmark = pytest.mark.integration

QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["Write a haiku.", "Now shorter."]},
    {"question_id": 2, "category": "coding", "turns": ["Reverse a string in Python."]},
    {"question_id": 3, "category": "coding", "turns": ["Sort a list.", "Descending?"]},
]


def test_questions_per_category(job_env, tmp_path):
    target = tiny_chat_llama(tmp_path / "target", seed=0)
    draft = tiny_chat_llama(tmp_path / "draft", seed=1)
    path = tmp_path / "question.jsonl"
    path.write_text("\n".join(json.dumps(q) for q in QUESTIONS))
    res = run_cmd([python(), "-m", "jobs.evaluate", "--config",
                   "experiments/smoke/evaluate.yaml", f"models.target={target}",
                   f"models.draft={draft}", "data.prompts=questions", f"data.path={path}",
                   "data.turns=2", "decoding.max_new_tokens=8",
                   "methods=[{name: chain, gamma: 2}]"], job_env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "[evaluate] category writing (2 prompts)" in res.stdout
    assert "[evaluate] category coding (3 prompts)" in res.stdout
    client, run = find_run(job_env["MLFLOW_TRACKING_URI"], "speclab-smoke")
    m = run.data.metrics
    assert m["prompts"] == 5
    for cat in ("writing", "coding"):
        assert m[f"category/{cat}/ar/tau"] == 1.0
        assert m[f"category/{cat}/chain_gamma_2/tau"] >= 1.0
        assert f"category/{cat}/chain_gamma_2/speedup_lo" in m
    local = client.download_artifacts(run.info.run_id, "categories.json", str(tmp_path))
    by_cat = json.loads(open(local).read())
    assert set(by_cat) == {"writing", "coding"}
    chain = [[r for r in rows if r["method"] == "chain(gamma=2)"][0] for rows in by_cat.values()]
    assert sum(r["prompts"] for r in chain) == 5
    whole = json.loads(open(client.download_artifacts(run.info.run_id, "results.json",
                                                      str(tmp_path))).read())
    assert sum(r["new_tokens"] for r in chain) == \
        [r for r in whole if r["method"] == "chain(gamma=2)"][0]["new_tokens"]
    assert all(r["identical_to_ar"] for r in chain)  # greedy: lossless per category too

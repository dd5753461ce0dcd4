"""Regeneration as a user runs it (``python -m jobs.regenerate --config
experiments/smoke/regenerate.yaml ...``) on a tiny ChatML LLaMA of SmolLM2's shape:

* the answers are the target's own (equal to the engine's greedy decoding of the
  rendered conversation, turn 2 seeing the target's answer to turn 1);
* a drafting method gives the same answers (T=0) and says its target calls per token;
* a rerun keeps finished shards and rewrites a lost one identically; other settings in
  the same folder, and a target without a chat template, are refused before any work;
* a drafter trains on the regenerated conversations (``corpus.source: conversations``),
  its rows carrying the assistant-only loss mask.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.gguf_fixture import tiny_chat_llama
from tests.integration.conftest import python, refused_before_work, run_cmd

pytestmark = pytest.mark.integration
CONFIG = "experiments/smoke/regenerate.yaml"
NEW = 10


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("regen_models")
    return {"target": str(tiny_chat_llama(root / "target", seed=0)),
            "draft": str(tiny_chat_llama(root / "draft", seed=1))}


def _run(env: dict, overrides: list[str]):
    res = run_cmd([python(), "-m", "jobs.regenerate", "--config", CONFIG, *overrides], env)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for p in sorted(out.glob("shard-*.jsonl"))
            for line in p.read_text().splitlines()]


def test_regenerate_resume_refuse_and_train(job_env, tmp_path, pair):
    from speclab.api import Decoder

    base = [f"models.target={pair['target']}", "corpus.max_conversations=6",
            f"regenerate.max_new_tokens={NEW}", "regenerate.actors=1",
            "regenerate.cpus_per_actor=1"]
    out_ar, out_sd = tmp_path / "ar", tmp_path / "sd"
    res = _run(job_env, [*base, "regenerate.method={name: ar}", f"regenerate.output={out_ar}"])
    assert "6 train conversations in 2 shards (0 already done)" in res.stdout
    assert "tokens/s, ETA" in res.stdout  # a progress line per shard
    manifest = json.loads((out_ar / "manifest.json").read_text())
    assert manifest["complete"] and manifest["shards_done"] == 2
    records = _records(out_ar)
    assert len(records) == 6 and manifest["last_run"]["answers"] == 12

    # the target's own answers: the engine's greedy decoding of the rendered turns
    dec = Decoder.from_pretrained(pair["target"])
    tok = dec.tokenizer
    src = {json.loads(x)["id"]: json.loads(x) for x in
           Path("experiments/smoke/data/chat.jsonl").read_text().splitlines()}
    for rec in records[:2]:
        msgs = rec["messages"]
        assert [m["role"] for m in msgs if m["role"] != "system"] == \
            ["user", "assistant", "user", "assistant"]
        users = [t["value"] for t in src[rec["id"]]["conversations"] if t["from"] == "human"]
        assert [m["content"] for m in msgs if m["role"] == "user"] == users[:2]
        for turn in (1, 3):  # after the first and the second user message
            upto = msgs[: [i for i, m in enumerate(msgs) if m["role"] == "user"][turn // 2] + 1]
            ids = tok.apply_chat_template(upto, tokenize=True, add_generation_prompt=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            got = dec.generate(prompt_ids=ids, method="ar", max_new_tokens=NEW)
            want = tok.decode([t for t in got.token_ids if t != dec.eos_token_id],
                              skip_special_tokens=True).strip()
            answer = [m for m in msgs if m["role"] == "assistant"][turn // 2]["content"]
            assert answer == want, (rec["id"], turn)

    # speculative decoding gives the same answers and reports its target calls
    res = _run(job_env, [*base, "regenerate.method={name: chain, gamma: 3}",
                         f"models.draft={pair['draft']}", f"regenerate.output={out_sd}"])
    assert "target calls per token" in res.stdout
    assert [r["messages"] for r in _records(out_sd)] == [r["messages"] for r in records]
    sd = json.loads((out_sd / "manifest.json").read_text())["last_run"]
    assert 0 < sd["target_calls_per_token"] <= 1.0

    # resume: a lost shard is rewritten, the other kept; its answers are the same
    lost = out_ar / "shard-00001.jsonl"
    before = lost.read_text()
    lost.unlink()
    res = _run(job_env, [*base, "regenerate.method={name: ar}", f"regenerate.output={out_ar}"])
    assert "(1 already done)" in res.stdout and "shard 1 done" in res.stdout
    assert "shard 0 done" not in res.stdout and lost.read_text() == before
    resumed = json.loads((out_ar / "manifest.json").read_text())
    assert resumed["last_run"]["answers"] < 12  # this run answered only the lost shard
    assert sorted(resumed["shard_results"]) == ["0", "1"]  # shard 0's figures were kept
    whole = resumed["all_shards"]
    assert whole["shards"] == 2 and whole["answers"] == 12
    assert whole["new_tokens"] == manifest["last_run"]["new_tokens"]
    assert whole["seconds"] == pytest.approx(sum(
        r["seconds"] for r in resumed["shard_results"].values()))
    assert "in all 2 shards: 12 answers" in res.stdout

    # other settings in the same folder, a target without a chat template: refused
    refused_before_work("regenerate", CONFIG, [*base, "regenerate.max_new_tokens=11",
                                               "regenerate.method={name: ar}",
                                               f"regenerate.output={out_ar}"],
                        "holds a regeneration with other settings (max_new_tokens)",
                        job_env, tmp_path)
    refused_before_work("regenerate", CONFIG, ["corpus.chat_template=null",
                                               f"regenerate.output={tmp_path / 'x'}"],
                        "corpus.chat_template: the target's tokenizer has no chat template",
                        job_env, tmp_path)

    # a drafter trains on the regenerated conversations, loss on assistant tokens only
    storage = tmp_path / "runs"
    res = run_cmd([python(), "-m", "jobs.train_drafter", "--config",
                   "experiments/smoke/train_drafter.yaml", f"models.target={pair['target']}",
                   "corpus.source=conversations", f"corpus.path={out_ar}", "distill.seq_len=24",
                   "train.steps=4", f"output.storage_path={storage}", "output.register_as=null",
                   "output.run_name=chat", "data.num_prompts=1"], job_env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "[corpus]" in res.stdout and "6 train conversations used" in res.stdout
    rows = pq.read_table(next((storage / "chat" / "data" / "feat").glob("shard-*.parquet"))
                         ).to_pylist()
    for row in rows:
        mask = row["loss_mask"]
        assert len(mask) == len(row["tokens"]) and mask[-1] == 1 and 0 < sum(mask)

    # online features: only the windows are stored, the target runs in the step
    res = run_cmd([python(), "-m", "jobs.train_drafter", "--config",
                   "experiments/smoke/train_drafter.yaml", f"models.target={pair['target']}",
                   "corpus.source=conversations", f"corpus.path={out_ar}", "distill.seq_len=24",
                   "train.steps=4", f"output.storage_path={storage}", "output.register_as=null",
                   "output.run_name=online", "data.num_prompts=1", "drafter.features=online"],
                  job_env)
    assert res.returncode == 0, res.stderr[-3000:]
    data = storage / "online" / "data"
    assert sorted(p.name for p in data.iterdir() if p.is_dir()) == ["windows"]
    row = pq.read_table(next((data / "windows").glob("shard-*.parquet"))).to_pylist()[0]
    assert set(row) == {"tokens", "loss_mask"}  # no features, no top-k on disk
    assert "ETA" in res.stdout  # the training progress line

"""``speclab bench --pair smollm2-135m``: the real pair's target by name and its drafters
from the MLflow registry, on a tiny model of SmolLM2's shape placed where the real one
is cached (nothing is downloaded or trained here); a drafter that is not registered is
refused naming the command that builds it, or left out when optional."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gguf_fixture import tiny_chat_llama

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def real_home(tmp_path) -> dict[str, str]:
    """A SPECLAB_HOME whose ``smollm2-135m`` is a tiny ChatML LLaMA, and an empty SQLite
    MLflow store: the environment of a bench subprocess."""
    home = tmp_path / "home"
    folder = tiny_chat_llama(home / "models" / "smollm2-135m")
    (folder / "source.json").write_text(json.dumps({"source": "test fixture"}))
    return {**os.environ, "SPECLAB_HOME": str(home), "SPECLAB_OFFLINE": "1",
            "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}


def _register(env: dict[str, str], folder: Path, name: str) -> None:
    """Log ``folder`` as a model registered as ``name`` in the bench's store (the env's
    MLFLOW_TRACKING_URI), leaving this process's MLFLOW_TRACKING_URI as it was."""
    from speclab.tracking import MlflowTracker

    old = os.environ.get("MLFLOW_TRACKING_URI")
    try:
        with MlflowTracker(env["MLFLOW_TRACKING_URI"], "speclab-test", name, {}) as t:
            t.log_model(folder, name)
    finally:
        if old is not None:
            os.environ["MLFLOW_TRACKING_URI"] = old


def _register_draft(env: dict[str, str], tmp_path: Path) -> None:
    """The target cut to one layer, registered as the real pair's standalone draft."""
    from transformers import AutoTokenizer

    from speclab.models.pruned import cut_model

    target = Path(env["SPECLAB_HOME"]) / "models" / "smollm2-135m"
    tok = AutoTokenizer.from_pretrained(target)
    draft = cut_model(str(target), 1, len(tok), tok.eos_token_id)
    draft.save_pretrained(tmp_path / "draft")
    tok.save_pretrained(tmp_path / "draft")
    _register(env, tmp_path / "draft", "speclab-draft-smollm2")


def _register_head(env: dict[str, str], draft: Path, out: Path) -> None:
    """A SpecDec++ head (untrained, depth 1) saved beside a copy of ``draft``, registered
    as the real pair's head, as jobs.specdecpp_eval registers it."""
    import shutil

    from transformers import AutoConfig

    from speclab.decoding.acceptance_head import AcceptanceHead, save_head

    shutil.copytree(draft, out)
    save_head(AcceptanceHead(AutoConfig.from_pretrained(draft).hidden_size, 1), out)
    _register(env, out, "speclab-specdecpp-smollm2-D1-w3")


def _bench(env: dict[str, str], out: Path, prompts: Path, *extra: str):
    return subprocess.run(
        [sys.executable, "-m", "speclab.cli", "bench", "--pair", "smollm2-135m", "--prompts",
         "2", "--max-new-tokens", "8", "--prompt-file", str(prompts), "--out", str(out),
         *extra], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)


def test_the_real_pair_refuses_a_missing_draft_naming_its_build(real_home, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "What is the capital of Portugal?"}\n')
    done = _bench(real_home, tmp_path / "out", prompts, "--no-build")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "no `speclab-draft-smollm2` (draft) is registered in sqlite:///" in done.stderr
    assert "jobs.distill --config " in done.stderr and "draft_smollm2.yaml" in done.stderr
    assert not (tmp_path / "out" / "bench.json").exists()


def test_the_real_pair_benches_with_its_registered_draft(real_home, tmp_path):
    _register_draft(real_home, tmp_path)
    _register_head(real_home, tmp_path / "draft", tmp_path / "head")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "What is the capital of Portugal?"}\n'
                       '{"prompt": "reverse a string"}\n')
    done = _bench(real_home, tmp_path / "out", prompts)
    assert done.returncode == 0, done.stderr[-3000:]
    # the optional drafters are not registered: left out, with the command that adds them
    assert "no registered speclab-eagle3-smollm2; its eagle rows are left out" in done.stdout
    assert "eagle3_smollm2.yaml" in done.stdout and "medusa_smollm2.yaml" in done.stdout
    assert "no registered speclab-hass-smollm2; its eagle rows are left out" in done.stdout
    assert "hass_smollm2.yaml" in done.stdout
    assert "no registered speclab-eagle3-regen-smollm2; its eagle rows are left out" in \
        done.stdout and "eagle3_regen_smollm2.yaml" in done.stdout
    result = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert result["meta"]["drafters"] == {
        "draft": ["models:/speclab-draft-smollm2/1"],
        "head": ["models:/speclab-specdecpp-smollm2-D1-w3/1"]}
    assert result["meta"]["target"].endswith("models/smollm2-135m")
    assert result["meta"]["prompts"] == 2 and not result["meta"]["partial"]
    methods = [r["method"] for r in result["rows"]]
    assert methods[0] == "ar" and "hf_assisted" in methods and "pld" in methods
    assert sum(m.startswith("chain") for m in methods) == 2
    for name in ("tree", "optimal", "salf", "specdecpp"):
        assert any(m.startswith(name) for m in methods), methods
    # greedy: every engine method and assisted generation decodes plain decoding's tokens
    assert all(r.get("identical_to_ar") for r in result["rows"]), \
        [(r["method"], r.get("identical_to_ar")) for r in result["rows"]]


def test_the_real_pairs_own_prompts_are_held_out_first_turns(tmp_path):
    """Without ``--prompt-file`` a real pair's prompts are held-out (test split) first
    turns of its conversations through the chat template."""
    from transformers import AutoTokenizer

    from speclab.bench import bench_prompts
    from speclab.data.conversations import split_of, template_ids

    convs = [{"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": f"answer {i}"},
        {"from": "human", "value": f"follow-up {i}"}]} for i in range(600)]
    path = tmp_path / "share.json"
    path.write_text(json.dumps(convs))
    tok = AutoTokenizer.from_pretrained(tiny_chat_llama(tmp_path / "m"))

    class Dec:  # what bench_prompts reads of a Decoder
        tokenizer = tok

    got = bench_prompts(Dec(), 3, chat_data=str(path))
    held = [c for c in convs if split_of(c["id"]) == "test"][:3]
    assert len(held) == 3
    assert list(got) == [template_ids(tok, [{"role": "user", "content": c["conversations"][0][
        "value"]}]) for c in held]


def test_a_head_trained_on_another_draft_is_left_out(real_home, tmp_path, monkeypatch):
    """The SpecDec++ head's predictions belong to the draft it was trained on: the newest
    head is used only when its copy of the draft has the weights of the draft in use."""
    import torch
    from transformers import AutoModelForCausalLM

    from speclab.real_pair import ensure_real_pair

    for key in ("SPECLAB_HOME", "SPECLAB_OFFLINE", "MLFLOW_TRACKING_URI"):
        monkeypatch.setenv(key, real_home[key])
    _register_draft(real_home, tmp_path)
    _register_head(real_home, tmp_path / "draft", tmp_path / "head")
    lines: list[str] = []
    pair = ensure_real_pair("smollm2-135m", build=False, log=lines.append)
    assert [Path(h).name for h in pair.heads] and pair.sources["head"] == [
        "models:/speclab-specdecpp-smollm2-D1-w3/1"]
    other = AutoModelForCausalLM.from_pretrained(tmp_path / "draft")
    with torch.no_grad():
        other.model.norm.weight.add_(0.5)  # another draft: its head must not be used
    other.save_pretrained(tmp_path / "other")
    _register_head(real_home, tmp_path / "other", tmp_path / "head2")
    lines.clear()
    pair = ensure_real_pair("smollm2-135m", build=False, log=lines.append)
    assert pair.heads == [] and "head" not in pair.sources
    assert any("models:/speclab-specdecpp-smollm2-D1-w3/2 was trained on another draft than "
               "models:/speclab-draft-smollm2/1" in line and "specdecpp_smollm2.yaml" in line
               for line in lines), lines


def test_the_real_pairs_drafters_are_labelled_by_their_registered_names(tmp_path):
    """Registered drafters download to folders of one name (``.../artifacts/eagle``): the
    bench's rows carry the registered name, so two EAGLE-3 drafters give two rows."""
    from speclab.bench import eagle_run
    from speclab.real_pair import RealPair

    folders = []
    for i in (1, 2):
        folder = tmp_path / str(i) / "eagle"
        folder.mkdir(parents=True)
        (folder / "config.json").write_text('{"kind": "speclab-eagle", "version": 3}')
        folders.append(str(folder))
    uris = ["models:/speclab-eagle3-smollm2/1", "models:/speclab-eagle3-regen-smollm2/2"]
    pair = RealPair("smollm2-135m", "t", "d", eagles=folders, sources={"eagle": uris})
    assert pair.named("eagle") == list(zip(folders, uris))
    labels = [eagle_run(d, uri).name for d, uri in pair.named("eagle")]
    assert [x.split(" ")[:2] for x in labels] == [["eagle3", uris[0]], ["eagle3", uris[1]]]
    assert pair.named("medusa") == []

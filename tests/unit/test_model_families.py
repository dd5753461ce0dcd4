"""Every decoder family users bring, as target and draft: tiny random models of each
(2 layers, hidden 64; the draft a noisy copy of the target), decoded by plain decoding
and by chain / EAGLE-2 tree / SALF, one prompt at a time and batched, must equal the
family's own Hugging Face greedy ``generate`` token for token. Contexts outgrow the
sliding windows (16) of Mistral, Starcoder2, Gemma-2 and Gemma-3, so the windowed masks
over a full cache are exercised, rolled back and compacted."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from speclab.api import Decoder
from speclab.decoding.attention import UnsupportedModel, attention_layout
from speclab.models.loading import ModelLoadError, load_model

from ..conftest import _noisy_copy

BASE = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "bos_token_id": None, "eos_token_id": None,
        "pad_token_id": None}
#: family -> its config's extra fields (sliding windows of 16 tokens where it has one)
FAMILIES = {
    "llama": {}, "qwen2": {}, "qwen3": {"head_dim": 16},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 32},
    "mistral": {"sliding_window": 16}, "starcoder2": {"sliding_window": 16},
    "gemma": {"head_dim": 16}, "gemma2": {"sliding_window": 16, "head_dim": 16},
    "gemma3_text": {"sliding_window": 16, "head_dim": 16, "sliding_window_pattern": 2},
    "phi3": {}, "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 4},
    "gpt_neox": {}, "opt": {"ffn_dim": 128, "word_embed_proj_dim": 64}, "olmo2": {},
    "phi": {},
}
METHODS = [("chain", {"gamma": 3}), ("tree", {"tree_top_k": 2, "depth": 3, "nodes": 6}),
           ("salf", {"nodes": 8, "batch": 2, "salf_threshold": 0.2})]
NEW = 28


def _prompts(n: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 90, (int(k),), generator=g).tolist() for k in (6, 19, 31)[:n]]


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """family -> (target folder, draft folder)."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for i, (name, extra) in enumerate(FAMILIES.items()):
        torch.manual_seed(100 + i)
        cfg = AutoConfig.for_model(name, **{**BASE, **extra})
        model = AutoModelForCausalLM.from_config(cfg)
        model.generation_config.eos_token_id = None
        target = str(root / name / "target")
        model.save_pretrained(target)
        out[name] = (target, _noisy_copy(target, str(root / name / "draft"), 0.2, seed=i))
    return out


def _hf_greedy(folder: str, prompt: list[int]) -> list[int]:
    model = load_model(folder)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                             min_new_tokens=NEW, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_decodes_exactly_as_hf_greedy(families, family):
    target, draft = families[family]
    prompts = _prompts()
    want = [_hf_greedy(target, p) for p in prompts]
    dec = Decoder.from_pretrained(target, draft)
    assert [dec.generate(prompt_ids=p, method="ar", max_new_tokens=NEW).token_ids
            for p in prompts] == want
    taus = []
    for name, knobs in METHODS:
        single = [dec.generate(prompt_ids=p, method=name, max_new_tokens=NEW, **knobs)
                  for p in prompts]
        assert [r.token_ids for r in single] == want, (family, name, "single")
        batched = dec.generate(prompts=prompts, method=name, max_new_tokens=NEW, **knobs)
        assert [r.token_ids for r in batched] == want, (family, name, "batched")
        taus.append(sum(r.stats.tau for r in single) / len(single))
    assert max(taus) > 1.2, taus  # drafts were accepted (and rolled back) for real
    plain = dec.generate(prompts=prompts, method="ar", max_new_tokens=NEW)
    assert [r.token_ids for r in plain] == want, (family, "ar", "batched")


def test_sliding_layouts_are_read_from_each_config(families):
    layouts = {f: attention_layout(load_model(families[f][0]).config) for f in FAMILIES}
    assert layouts["mistral"].window == 16 and not layouts["mistral"].mixed
    assert layouts["gemma3_text"].mixed and layouts["gemma2"].mixed
    assert layouts["llama"].window is None and layouts["qwen2"].window is None
    assert load_model(families["gemma2"][0]).config._attn_implementation == "eager"
    assert load_model(families["llama"][0]).config._attn_implementation == "sdpa"
    assert load_model(families["llama"][0], attn_implementation="eager"
                      ).config._attn_implementation == "eager"


def test_unsupported_layer_kinds_and_implementations_are_refused_by_name(families, tmp_path):
    cfg = AutoConfig.for_model("qwen2", **BASE)
    cfg.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(UnsupportedModel, match="qwen2.*chunked_attention"):
        attention_layout(cfg)
    with pytest.raises(ModelLoadError, match="attn_implementation"):
        load_model(families["llama"][0], attn_implementation="flash")
    with pytest.raises(ModelLoadError, match="models.target"):
        load_model(families["gemma2"][0], field="models.target", attn_implementation="sdpa")


def _check_model(*args: str, cwd) -> tuple[int, str]:
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "speclab.cli", "check-model", *args,
                          "--out", str(cwd / "out")], capture_output=True, text=True,
                         timeout=300, cwd=cwd)
    return run.returncode, run.stdout + run.stderr


def test_check_model_reports_a_users_checkpoint_and_refuses_what_it_cannot_decode(
        families, tmp_path):
    """``speclab check-model`` (a subprocess, as a user runs it): a sliding-window family
    with its draft passes every method, single and batched (exit 0, JSON written); a
    model with a layer kind the engine does not honour is REFUSED naming it (exit 2)."""
    import json

    target, draft = families["gemma3_text"]
    rc, out = _check_model("--target", target, "--draft", draft, "--num-prompts", "2",
                           "--max-new-tokens", "24", cwd=tmp_path)
    assert rc == 0, out
    assert "model_type=gemma3_text" in out and "sliding-window (16)" in out
    report = json.loads((tmp_path / "out" / "check_model.json").read_text())
    assert {(r["method"], r["mode"]) for r in report["rows"]} == {
        (m, mode) for m in ("ar", "pld", "chain", "tree", "salf")
        for mode in ("single", "batched")}
    assert all(r["identical"] == 2 and r["differing"] == 0 for r in report["rows"])
    cfg = AutoConfig.for_model("qwen2", **BASE)
    cfg.layer_types = ["full_attention", "chunked_attention"]
    bad = tmp_path / "chunked"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(bad)
    rc, out = _check_model("--target", str(bad), cwd=tmp_path)
    assert rc == 2 and "REFUSED" in out and "chunked_attention" in out, out


@pytest.mark.parametrize("family", ["gemma", "mistral", "qwen2"])
def test_feature_drafters_train_and_decode_on_other_families(families, family, tmp_path):
    """EAGLE drafters (a LLaMA-style layer with the target's sizes, reading the LM head's
    input) and Medusa heads train on a Gemma (tied embeddings), a Mistral (sliding
    window) and a Qwen2 target and decode them exactly, one prompt at a time and
    batched."""
    from speclab.families.eagle.model import save_eagle
    from speclab.families.medusa.model import save_medusa

    from .test_eagle import _train as train_eagle
    from .test_medusa import _train as train_medusa

    target, _ = families[family]
    eagle, eagle_losses, batch = train_eagle(target, 40, windows=16, length=24)
    heads, medusa_losses = train_medusa(target, 40)
    assert eagle_losses[-1] < eagle_losses[0] and medusa_losses[-1] < medusa_losses[0]
    prompts = _prompts()
    want = [_hf_greedy(target, p) for p in prompts]
    dec = Decoder.from_pretrained(target)
    for knobs in ({"method": "eagle", "eagle_model": str(save_eagle(eagle, tmp_path / "e")),
                   "builder": "salf", "nodes": 8, "batch": 2},
                  {"method": "medusa", "tree": "sparse", "nodes": 8,
                   "medusa_model": str(save_medusa(heads, tmp_path / "m", heads.tree))}):
        single = [dec.generate(prompt_ids=p, max_new_tokens=NEW, **knobs) for p in prompts]
        assert [r.token_ids for r in single] == want, (family, knobs["method"])
        batched = dec.generate(prompts=prompts, max_new_tokens=NEW, **knobs)
        assert [r.token_ids for r in batched] == want, (family, knobs["method"], "batched")
        # accepted on a start like the training data's (a random tiny Gemma repeats one
        # token forever, so a drafter trained on its continuations knows those tokens)
        seen = batch["tokens"][0, :3].tolist()
        res = dec.generate(prompt_ids=seen, max_new_tokens=NEW, **knobs)
        assert res.token_ids == _hf_greedy(target, seen)
        assert res.stats.accepted_tokens > 0, (family, knobs["method"])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_fast_paths_static_layout_decodes_every_family(families, family, monkeypatch):
    """The fast path's static cache and masks (run eagerly here: compiling each family
    would take minutes) give HF greedy's tokens for every family, sliding windows
    included."""
    from speclab.decoding.static_runner import FastPath, StaticBatchRunner

    target, draft = families[family]
    dec = Decoder.from_pretrained(target, draft)
    monkeypatch.setattr(dec, "compile", True)
    # 96 slots per row: the frontier reaches them within a few rounds, so the rows are
    # compacted in place mid-decode (the windows then read the gathered positions)
    monkeypatch.setattr(dec, "batch_runner", lambda model, rows, capacity: StaticBatchRunner(
        FastPath(model, rows, 96, compile=False)))
    prompts = _prompts()
    want = [_hf_greedy(target, p) for p in prompts]
    for name, knobs in METHODS[::2]:
        res = dec.generate(prompts=prompts, method=name, max_new_tokens=NEW, **knobs)
        assert [r.token_ids for r in res] == want, (family, name)

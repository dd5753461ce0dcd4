"""``python -m speclab.models.formats.roundtrip``: an EAGLE-3 drafter exported to the
public formats, each export loaded back (the ``--eagle-model DIR`` path) and decoded on
held-out chat prompts; the command says whether every copy is the drafter exactly (tiny
chat target with ChatML, a ShareGPT-shaped file)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from speclab.data.conversations import split_of
from speclab.families.eagle.model import save_eagle
from speclab.families.eagle.model3 import Eagle3Model
from speclab.models.formats import roundtrip
from speclab.models.loading import load_model
from speclab.models.tiny import build_tiny_llama
from tests.gguf_fixture import tiny_chat_llama


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """An 8-layer LLaMA with the ChatML tokenizer of the GGUF fixture, and an EAGLE-3
    drafter for it (reduced vocabulary, weights moved off their start)."""
    root = tmp_path_factory.mktemp("rt")
    chat = tiny_chat_llama(root / "chat")
    vocab = json.loads((chat / "config.json").read_text())["vocab_size"]
    target = build_tiny_llama(root / "target", seed=3, vocab_size=vocab, num_layers=8)
    for f in chat.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, target / f.name)
    model = load_model(str(target))
    torch.manual_seed(0)
    drafter = Eagle3Model.from_target(model, draft_ids=torch.arange(0, vocab, 2))
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if not name.startswith(("embed.", "lm_head.")):
                p.add_(torch.randn(p.shape) * 0.1)
    ids = [f"c{i}" for i in range(400) if split_of(f"c{i}") == "test"][:3]
    convs = [{"id": i, "conversations": [{"from": "human", "value": f"Reverse string {i}."},
                                         {"from": "gpt", "value": "s[::-1]"}]} for i in ids]
    (root / "chats.json").write_text(json.dumps(convs))
    return {"target": str(target), "drafter": save_eagle(drafter, root / "e3"),
            "chats": str(root / "chats.json"), "root": root}


def test_every_export_loads_back_and_decodes_as_the_drafter(pair, capsys):
    out = pair["root"] / "exports"
    rc = roundtrip.main([str(pair["drafter"]), "--target", pair["target"], "--prompts", "3",
                         "--prompts-from", pair["chats"], "--max-new-tokens", "12",
                         "--out", str(out), "--json", str(pair["root"] / "rt.json")])
    printed = capsys.readouterr().out
    rows = json.loads((pair["root"] / "rt.json").read_text())
    assert rc == 0, printed
    assert [r["copy"] for r in rows] == ["source", "speculators", "eagle"]
    assert (out / "speculators" / "model.safetensors").exists()
    assert (out / "eagle" / "pytorch_model.bin").exists()
    for r in rows:
        assert r["max_param_diff"] == 0.0 and r["prompts"] == 3
        assert r["outputs_equal"] == r["accepted_equal"] == 3
    assert len({r["tau"] for r in rows}) == 1
    assert "speculators" in printed and "3/3" in printed


def test_an_export_that_changed_a_weight_fails_the_command(pair, monkeypatch, capsys):
    """An export that wrote one tensor 1% off is caught (parameter difference), so the
    command cannot pass on copies that merely decode."""
    from speclab.models.formats import convert

    real = convert.export_drafter

    def off_by_one_percent(*args, **kwargs):
        out = real(*args, **kwargs)
        state = torch.load(out / "pytorch_model.bin", weights_only=True)
        state["fc.weight"] = state["fc.weight"] * 1.01
        torch.save(state, out / "pytorch_model.bin")
        return out

    monkeypatch.setattr(convert, "export_drafter", off_by_one_percent)
    rc = roundtrip.main([str(pair["drafter"]), "--target", pair["target"], "--prompts", "2",
                         "--prompts-from", pair["chats"], "--max-new-tokens", "4",
                         "--formats", "eagle"])
    assert rc == 1, capsys.readouterr().out

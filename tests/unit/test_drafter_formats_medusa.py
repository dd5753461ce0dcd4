"""Medusa checkpoints users have (issue 57): tiny checkpoints written the way
FasterDecoding/Medusa's code writes them (its ``ResBlock``, its ``medusa_head``
ModuleList built as ``nn.Sequential(*([ResBlock(H)] * medusa_num_layers), ...)``, saved
with ``torch.save`` / ``save_file`` / the MEDUSA-2 model's ``save_pretrained``) load to
heads whose logits equal that code's, computed here from the file with
``load_state_dict``: MEDUSA-1 heads with ``medusa_num_layers = 2`` (one shared block),
legacy "version 2" heads (no LM head of their own: the target's), MEDUSA-2 models
(``medusa_head.*`` inside the fine-tuned model's weights, one file, shards or
``pytorch_model.bin``) and a config that lists fewer heads than the file holds. Greedy
decoding with each equals plain greedy decoding. The export writes ``medusa_lm_head.pt``
that Medusa's module loads with ``strict=True``. Variants that are not Medusa's
computation are refused naming the file and the flag."""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from speclab.api import Decoder
from speclab.families.medusa.model import (
    MedusaHeads,
    load_medusa,
    save_medusa,
    target_fingerprint,
)
from speclab.models.formats import DrafterFormatError, export_drafter, load_drafter
from speclab.models.formats.detect import detect_drafter_format
from speclab.models.formats.medusa_format import read_medusa
from speclab.models.loading import load_model

PROMPT = [3, 9, 27, 17, 51, 2]
H, V = 32, 64  # the tiny target's sizes (conftest tiny_pair)
TOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target(tiny_pair):
    return load_model(tiny_pair["target"])


# --- Medusa's modules, as FasterDecoding/Medusa medusa/model/medusa_model.py defines them


class ResBlock(nn.Module):
    """Medusa's ResBlock: ``x + SiLU(linear(x))``, the linear's weight zero-initialised."""

    def __init__(self, hidden_size):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        torch.nn.init.zeros_(self.linear.weight)
        self.act = nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


def medusa_head(heads: int, layers: int, lm_head: bool = True) -> nn.ModuleList:
    """``medusa_model.py``'s ``medusa_head`` (``lm_head=False``: ``medusa_model_legacy.py``'s,
    whose heads go through the base model's ``lm_head``)."""
    return nn.ModuleList([
        nn.Sequential(*([ResBlock(H)] * layers),
                      *([nn.Linear(H, V, bias=False)] if lm_head else []))
        for _ in range(heads)])


def trained(module: nn.Module, seed: int) -> nn.Module:
    """Random 'trained' weights (the residual blocks small, so the heads stay sensible)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "linear" in name else 1.0))
    return module


def write_heads(folder, module: nn.ModuleList, layers: int, config_heads: int | None = None,
                file: str = "medusa_lm_head.pt", version: str | None = None) -> dict:
    """A heads-only checkpoint: Medusa's config and the ModuleList's state dict (shared
    blocks stay shared in ``torch.save``, as in Medusa's own files)."""
    folder.mkdir(parents=True)
    cfg = {"medusa_num_heads": config_heads or len(module), "medusa_num_layers": layers,
           "base_model_name_or_path": "tiny-target"}
    if version:
        cfg["version"] = version
    (folder / "config.json").write_text(json.dumps(cfg))
    state = module.state_dict()
    if file.endswith(".safetensors"):
        save_file({k: v.contiguous() for k, v in state.items()}, str(folder / file))
    else:
        torch.save(state, folder / file)
    return state


def features(model, ids=PROMPT) -> torch.Tensor:
    """The target's last hidden state (after the final norm): Medusa's ``outputs[0]``."""
    with torch.no_grad():
        return model.model(torch.tensor([ids])).last_hidden_state[0]  # [T, H]


def assert_logits(heads: MedusaHeads, reference, hidden: torch.Tensor) -> None:
    with torch.no_grad():
        got = heads(hidden)  # [K, T, V]
        for k in range(heads.meta.heads):
            want = reference(k, hidden)
            assert got[k].shape == want.shape
            assert (got[k] - want).abs().max().item() <= TOL, k


def plain_greedy(model, n: int = 12) -> list[int]:
    """Greedy decoding with the HF model itself (no speculation)."""
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT):]


def medusa_greedy(dec: Decoder, heads, n: int = 12) -> list[int]:
    return dec.generate(prompt_ids=PROMPT, max_new_tokens=n, method="medusa",
                        medusa_model=heads, tree="cartesian", tree_top_k=2).token_ids


# --- MEDUSA-1 heads with a repeated block ---------------------------------------------


def test_medusa_num_layers_2_repeats_one_shared_block(tmp_path, tiny_pair, target):
    ref = trained(medusa_head(3, 2), seed=1)
    assert ref[0][0] is ref[0][1]  # Medusa's list multiplication: ONE block, twice
    folder = tmp_path / "l2"
    state = write_heads(folder, ref, layers=2)
    assert torch.equal(state["0.0.linear.weight"], state["0.1.linear.weight"])
    check = medusa_head(3, 2)  # Medusa's module, loaded from the file
    check.load_state_dict(torch.load(folder / "medusa_lm_head.pt"), strict=True)
    heads = load_medusa(folder, target)
    assert heads.meta.blocks == 2 and not heads.meta.shared_lm_head
    hidden = features(target)
    assert_logits(heads, lambda k, h: check[k](h), hidden)
    # a one-block reading would differ: the test can see the second application
    once = medusa_head(3, 1)
    once.load_state_dict({k.replace(".2.weight", ".1.weight"): v for k, v in state.items()
                          if ".1.linear" not in k}, strict=True)
    with torch.no_grad():
        assert (once[0](hidden) - check[0](hidden)).abs().max() > 1e-3
    # the folder decodes through the drafter path like plain greedy decoding
    dec = Decoder.from_pretrained(tiny_pair["target"])
    assert medusa_greedy(dec, str(folder)) == plain_greedy(target)
    # and survives speclab's own format
    again = load_medusa(save_medusa(heads, tmp_path / "mine"), target)
    assert again.meta.blocks == 2
    assert_logits(again, lambda k, h: check[k](h), hidden)


def test_separate_blocks_are_refused_naming_the_flag(tmp_path, target):
    ref = trained(medusa_head(2, 2), seed=2)
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    state["1.1.linear.weight"] += 0.01  # two different blocks: not Medusa's module
    folder = tmp_path / "sep"
    write_heads(folder, ref, layers=2)
    torch.save(state, folder / "medusa_lm_head.pt")
    with pytest.raises(DrafterFormatError, match=r"medusa_model: .*sep/medusa_lm_head.pt: "
                       r"1.0.linear.weight and 1.1.linear.weight differ: "
                       r"medusa_num_layers=2 means ONE residual block"):
        load_medusa(folder, target)


# --- legacy "version 2" heads: the target's LM head -----------------------------------


@pytest.mark.parametrize("layers,file", [(1, "medusa_lm_head.safetensors"),
                                         (2, "medusa_lm_head.pt")])
def test_version2_heads_go_through_the_targets_lm_head(tmp_path, tiny_pair, target, layers,
                                                       file):
    ref = trained(medusa_head(3, layers, lm_head=False), seed=3)
    folder = tmp_path / "v2"
    write_heads(folder, ref, layers, file=file, version="2")
    check = medusa_head(3, layers, lm_head=False)  # medusa_model_legacy.py's module
    state = (load_file(str(folder / file)) if file.endswith(".safetensors")
             else torch.load(folder / file))
    check.load_state_dict(state, strict=True)
    heads = load_medusa(folder, target)
    assert heads.meta.shared_lm_head and heads.meta.blocks == layers
    assert heads.meta.fingerprint == target_fingerprint(target)  # tied to that LM head
    hidden = features(target)
    # medusa_model_legacy.py: mlogits = self.base_model.lm_head(self.medusa_head[i](h))
    assert_logits(heads, lambda k, h: target.lm_head(check[k](h)), hidden)
    dec = Decoder.from_pretrained(tiny_pair["target"])
    assert medusa_greedy(dec, heads) == plain_greedy(target)
    # the speclab folder they save to records the variant and is self-contained
    mine = save_medusa(heads, tmp_path / "mine")
    assert json.loads((mine / "config.json").read_text())["shared_lm_head"] is True
    assert_logits(load_medusa(mine), lambda k, h: target.lm_head(check[k](h)), hidden)
    # load_drafter / export take the target as a folder too
    assert_logits(load_drafter(folder, tiny_pair["target"]),
                  lambda k, h: target.lm_head(check[k](h)), hidden)


def test_version2_heads_without_a_target_are_refused_saying_what_to_pass(tmp_path, target):
    folder = tmp_path / "v2"
    write_heads(folder, trained(medusa_head(2, 1, lm_head=False), seed=4), 1, version="2")
    with pytest.raises(DrafterFormatError, match=r"medusa_model: .*v2/medusa_lm_head.pt: "
                       r"holds Medusa 'version 2' heads .*no 0.1.weight.*target's LM head"
                       r".*--format speclab --target TARGET"):
        load_medusa(folder)
    # a target of another width is refused naming the block's shape
    wide = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=4))
    with pytest.raises(DrafterFormatError, match=r"v2/medusa_lm_head.pt: 0.0.linear.weight "
                       r"has shape \[32, 32\], expected \[48, 48\]"):
        load_medusa(folder, target_config=target.config,
                    target=wide)  # the heads' file is 32 wide, the target 48


# --- MEDUSA-2: the heads inside the fine-tuned model's weights -------------------------


def write_medusa2(folder, how: str, heads: int = 3) -> LlamaForCausalLM:
    """A MEDUSA-2 model: a LLaMA with Medusa's ``medusa_head`` (each head's LM head a copy
    of the model's, as the axolotl recipe starts it, then 'trained'), its config carrying
    ``medusa_num_heads`` / ``medusa_num_layers``, saved with ``save_pretrained``."""
    torch.manual_seed(7)
    cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=4 * H,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked: greedy decoding well defined
    model.medusa_head = trained(medusa_head(heads, 1), seed=8)
    with torch.no_grad():
        for i in range(heads):
            model.medusa_head[i][-1].weight.add_(model.lm_head.weight)
    model.config.medusa_num_heads, model.config.medusa_num_layers = heads, 1
    if how == "bin":  # the pickle layout of older transformers' save_pretrained
        model.config.save_pretrained(folder)
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    else:
        model.save_pretrained(folder, **({"max_shard_size": "40KB"} if how == "shards"
                                         else {}))
    return model.eval()


@pytest.mark.parametrize("how,file", [("one", "model.safetensors"),
                                      ("shards", "model.safetensors.index.json"),
                                      ("bin", "pytorch_model.bin")])
def test_medusa2_heads_load_from_the_models_weights(tmp_path, how, file):
    folder = tmp_path / "m2"
    model = write_medusa2(folder, how)
    assert (folder / file).exists()
    backbone = load_model(str(folder))  # the target: that same fine-tuned model
    heads = read_medusa(folder, backbone.config, "medusa_model")
    assert heads.meta.target == str(folder) and heads.meta.heads == 3
    assert heads.meta.fingerprint == target_fingerprint(backbone)
    heads.meta.check_target(backbone)
    hidden = features(backbone)
    # medusa_model.py: medusa_logits.append(self.medusa_head[i](hidden_states))
    assert_logits(heads, lambda k, h: model.medusa_head[k](h), hidden)
    assert detect_drafter_format(folder) == "medusa"  # the user's path: --medusa-model DIR
    if how == "one":
        dec = Decoder.from_pretrained(str(folder))
        assert medusa_greedy(dec, heads) == plain_greedy(backbone)
        assert medusa_greedy(dec, str(folder)) == plain_greedy(backbone)


def test_medusa2_heads_with_another_target_are_refused(tmp_path, target):
    folder = tmp_path / "m2"
    write_medusa2(folder, "one")
    heads = read_medusa(folder, target.config, "medusa_model")
    with pytest.raises(ValueError, match=r"medusa_model: heads trained for target .*m2.* "
                       r"other weights"):
        heads.meta.check_target(target)  # the original target, not the fine-tuned one


# --- a config listing fewer heads than the file ---------------------------------------


def test_heads_beyond_medusa_num_heads_are_ignored_as_medusa_does(tmp_path, tiny_pair,
                                                                  target, caplog):
    full = trained(medusa_head(5, 1), seed=9)
    folder = tmp_path / "five"
    write_heads(folder, full, 1, config_heads=3, file="medusa_lm_head.safetensors")
    check = medusa_head(3, 1)  # Medusa builds medusa_num_heads heads, loads strict=False
    result = check.load_state_dict(load_file(str(folder / "medusa_lm_head.safetensors")),
                                   strict=False)
    assert not result.missing_keys
    assert sorted({k.split(".")[0] for k in result.unexpected_keys}) == ["3", "4"]
    with caplog.at_level(logging.WARNING, logger="speclab.models.formats.medusa_format"):
        heads = load_medusa(folder, target)
    assert heads.meta.heads == 3
    assert "2 more head(s) (3, 4) than medusa_num_heads=3" in caplog.text
    assert_logits(heads, lambda k, h: check[k](h), features(target))
    dec = Decoder.from_pretrained(tiny_pair["target"])
    assert medusa_greedy(dec, str(folder)) == plain_greedy(target)


def test_fewer_heads_in_the_file_than_the_config_are_refused(tmp_path, target):
    folder = tmp_path / "two"
    write_heads(folder, trained(medusa_head(2, 1), seed=10), 1, config_heads=3)
    with pytest.raises(DrafterFormatError, match=r"two/medusa_lm_head.pt: has no 2.1.weight "
                       r".*medusa_num_heads=3"):
        load_medusa(folder, target)


# --- export: medusa_lm_head.pt for Medusa's own loaders --------------------------------


@pytest.mark.parametrize("layers", [1, 2])
def test_export_writes_a_pt_that_medusas_module_loads_strictly(tmp_path, tiny_pair, target,
                                                                layers):
    src = tmp_path / "src"
    write_heads(src, trained(medusa_head(3, layers), seed=11), layers)
    heads = load_medusa(src, target)
    mine = save_medusa(heads, tmp_path / "mine")
    out = export_drafter(mine, "medusa", tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["medusa_num_heads"] == 3 and cfg["medusa_num_layers"] == layers
    # what Medusa's from_pretrained does with the file, here strict
    check = medusa_head(cfg["medusa_num_heads"], cfg["medusa_num_layers"])
    state = torch.load(out / "medusa_lm_head.pt", map_location="cpu")
    check.load_state_dict(state, strict=True)
    hidden = features(target)
    assert_logits(heads, lambda k, h: check[k](h), hidden)
    # TGI's safetensors holds the same tensors under the same names
    st = load_file(str(out / "medusa_lm_head.safetensors"))
    assert st.keys() == state.keys() and all(torch.equal(st[k], state[k]) for k in st)
    assert_logits(load_medusa(out, target), lambda k, h: check[k](h), hidden)


@pytest.mark.parametrize("k", [3, 5, 6])
def test_export_warns_when_medusas_heads_only_loader_builds_another_head_count(
        tmp_path, target, k):
    """``medusa_model.py``'s ``MedusaModel.from_pretrained`` (Medusa's CLI) reads a
    heads-only folder through its fallback: ``base_model_config.medusa_num_heads = 5``
    whatever config.json says, then ``medusa_head.load_state_dict(state, strict=False)``.
    Done here with Medusa's module: with ``k != 5`` heads that load misses heads (left
    random) or drops some, silently, and ``speclab export`` prints a warning naming
    medusa_num_heads and the loader that reads it (``medusa_model_legacy.py``, whose
    module of ``medusa_num_heads`` heads loads the file strictly)."""
    import contextlib
    import io

    from speclab.cli import main

    src = tmp_path / "src"
    write_heads(src, trained(medusa_head(k, 1), seed=20 + k), 1)
    mine = save_medusa(load_medusa(src, target), tmp_path / "mine")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["export", str(mine), "--format", "medusa", "--out",
                     str(tmp_path / "out")]) == 0
    printed = printed.getvalue()
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    state = torch.load(tmp_path / "out" / "medusa_lm_head.pt", map_location="cpu")
    fallback = medusa_head(5, cfg["medusa_num_layers"]).load_state_dict(state, strict=False)
    silently_wrong = bool(fallback.missing_keys or fallback.unexpected_keys)
    assert silently_wrong is (k != 5)
    assert ("warning: medusa_num_heads=" in printed) is silently_wrong
    if silently_wrong:
        assert f"warning: medusa_num_heads={k}: " in printed
        assert "medusa_model.MedusaModel.from_pretrained" in printed
        assert "builds 5 heads" in printed and "strict=False" in printed
        assert "medusa_model_legacy.MedusaModel.from_pretrained(DIR)" in printed
        assert (f"heads {k}..4 stay randomly initialised" if k < 5
                else "head 5 is dropped") in printed
    # the legacy loader builds medusa_num_heads heads: every tensor has its place
    medusa_head(cfg["medusa_num_heads"], cfg["medusa_num_layers"]).load_state_dict(
        state, strict=True)


def test_export_of_version2_heads_writes_their_lm_heads(tmp_path, tiny_pair, target):
    src = tmp_path / "v2"
    ref = trained(medusa_head(2, 1, lm_head=False), seed=12)
    write_heads(src, ref, 1, version="2")
    out = export_drafter(src, "medusa", tmp_path / "out", target=tiny_pair["target"])
    check = medusa_head(2, 1)  # MEDUSA-1's module: each head with its LM head
    check.load_state_dict(torch.load(out / "medusa_lm_head.pt"), strict=True)
    assert_logits(load_medusa(out), lambda k, h: target.lm_head(ref[k](h)),
                  features(target))
    assert_logits(load_medusa(out), lambda k, h: check[k](h), features(target))

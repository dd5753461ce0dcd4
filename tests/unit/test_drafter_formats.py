"""Drafters in and out (issue 36): tiny checkpoints written from the public formats' key
names and config fields (EAGLE-1/2 / HASS research code, speculators ``eagle``, Medusa)
load to drafters whose outputs equal a direct computation from the file's tensors; an
export to a public format and back decodes with the same per-round accepted lengths;
unknown folders, EAGLE-3 folders whose files contradict their markers and drafters for
another target are refused naming the file and the field; the speculators config carries
what vLLM reads."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from speclab.api import Decoder
from speclab.families.eagle.model import EagleMeta, EagleModel, load_eagle, save_eagle
from speclab.families.medusa.model import MedusaHeads, MedusaMeta, load_medusa, save_medusa
from speclab.models.formats import (
    DrafterFormatError,
    check_exports,
    detect_drafter_format,
    export_drafter,
)
from speclab.models.loading import load_model
from speclab.models.tiny import build_tiny_llama

PROMPT = [3, 9, 27, 17, 51, 2]
H, V, HEADS, INTER = 32, 64, 4, 64  # the tiny target's sizes (conftest tiny_pair)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target(tiny_pair):
    return load_model(tiny_pair["target"])


def _rand(g: torch.Generator, *shape: int, scale: float = 0.3) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * scale


def _layer(g: torch.Generator, prefix: str, kv: int, input_norm: bool) -> dict:
    hd = H // HEADS
    t = {f"{prefix}self_attn.q_proj.weight": _rand(g, HEADS * hd, H),
         f"{prefix}self_attn.k_proj.weight": _rand(g, kv * hd, H),
         f"{prefix}self_attn.v_proj.weight": _rand(g, kv * hd, H),
         f"{prefix}self_attn.o_proj.weight": _rand(g, H, HEADS * hd),
         f"{prefix}mlp.gate_proj.weight": _rand(g, INTER, H),
         f"{prefix}mlp.up_proj.weight": _rand(g, INTER, H),
         f"{prefix}mlp.down_proj.weight": _rand(g, H, INTER),
         f"{prefix}post_attention_layernorm.weight": 1 + _rand(g, H, scale=0.1)}
    if input_norm:
        t[f"{prefix}input_layernorm.weight"] = 1 + _rand(g, H, scale=0.1)
    return t


def _llama_cfg(layers: int, kv: int, hidden: int = H) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": hidden, "intermediate_size": INTER, "num_attention_heads": HEADS,
            "num_key_value_heads": kv, "num_hidden_layers": layers, "vocab_size": V,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
            "max_position_embeddings": 512, "hidden_act": "silu", "pretraining_tp": 1}


def write_eagle_research(folder, layers=1, kv=HEADS, bias=True, embed=True,
                         file="pytorch_model.bin", seed=0, hidden=H) -> dict:
    """An EAGLE-1/2 checkpoint as SafeAILab/EAGLE's cnets.Model saves it."""
    g = torch.Generator().manual_seed(seed)
    t = {"fc.weight": _rand(g, H, 2 * H)}
    if bias:
        t["fc.bias"] = _rand(g, H, scale=0.1)
    for i in range(layers):  # layer 0 has no input_layernorm (cnets.py: index != 0)
        t.update(_layer(g, f"layers.{i}.", kv, i > 0))
    if embed:
        t["embed_tokens.weight"] = _rand(g, V, H, scale=1.0)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(_llama_cfg(layers, kv, hidden)))
    if file.endswith(".safetensors"):
        save_file(t, str(folder / file))
    else:
        torch.save(t, folder / file)
    return t


def write_speculators(folder, bias=True, seed=1, verifier="tiny-target") -> dict:
    """A speculators ``eagle`` checkpoint: config fields and weight names of
    speculators' EagleSpeculator (fusion_fc, transformer, no embedding / LM head)."""
    g = torch.Generator().manual_seed(seed)
    t = {"fusion_fc.weight": _rand(g, H, 2 * H)}
    if bias:
        t["fusion_fc.bias"] = _rand(g, H, scale=0.1)
    t.update(_layer(g, "transformer.", HEADS, False))
    layer_cfg = _llama_cfg(1, HEADS)
    cfg = {"architectures": ["EagleSpeculator", "LlamaDecoderLayer"],
           "speculators_model_type": "eagle", "speculators_version": "0.1.0",
           "transformer_layer_architecture": "LlamaDecoderLayer",
           "transformer_layer_config": layer_cfg, "layernorms": False, "fusion_bias": bias,
           "speculators_config": {
               "algorithm": "eagle", "default_proposal_method": "greedy",
               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
               "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]}}}
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(t, str(folder / "model.safetensors"))
    return t


def write_medusa(folder, heads=3, layers=1, file="medusa_lm_head.safetensors", seed=2,
                 vocab=V) -> dict:
    """A Medusa checkpoint as FasterDecoding/Medusa's medusa_head ModuleList saves it."""
    g = torch.Generator().manual_seed(seed)
    t = {}
    for k in range(heads):
        for j in range(layers):
            t[f"{k}.{j}.linear.weight"] = _rand(g, H, H)
            t[f"{k}.{j}.linear.bias"] = _rand(g, H, scale=0.1)
        t[f"{k}.{layers}.weight"] = _rand(g, vocab, H, scale=1.0)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(
        {"medusa_num_heads": heads, "medusa_num_layers": layers,
         "base_model_name_or_path": "tiny-target"}))
    if file.endswith(".safetensors"):
        save_file(t, str(folder / file))
    else:
        torch.save(t, folder / file)
    return t


# --- the reference computation, from the raw tensors --------------------------------


def _f64(t: dict) -> dict:
    return {k: v.double() for k, v in t.items()}


def _rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, theta=10000.0):  # x [B, heads, T, hd], positions 0..T-1
    hd, n = x.shape[-1], x.shape[-2]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
    ang = torch.arange(n).float()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    rot = torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1)
    return x * cos + rot * sin


def _llama_layer(x, t, p, kv, input_norm):
    """One LLaMA decoder layer, written out: (norm) -> causal attention with RoPE ->
    residual -> norm -> SwiGLU MLP -> residual."""
    b, n, _ = x.shape
    hd = H // HEADS
    h = _rms(x, t[p + "input_layernorm.weight"]) if input_norm else x
    q = (h @ t[p + "self_attn.q_proj.weight"].T).view(b, n, HEADS, hd).transpose(1, 2)
    k = (h @ t[p + "self_attn.k_proj.weight"].T).view(b, n, kv, hd).transpose(1, 2)
    v = (h @ t[p + "self_attn.v_proj.weight"].T).view(b, n, kv, hd).transpose(1, 2)
    k, v = k.repeat_interleave(HEADS // kv, 1), v.repeat_interleave(HEADS // kv, 1)
    q, k = _rope(q), _rope(k)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
    att = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, H)
    x = x + att @ t[p + "self_attn.o_proj.weight"].T
    h = _rms(x, t[p + "post_attention_layernorm.weight"])
    mlp = F.silu(h @ t[p + "mlp.gate_proj.weight"].T) * (h @ t[p + "mlp.up_proj.weight"].T)
    return x + mlp @ t[p + "mlp.down_proj.weight"].T


def eagle_reference(t, feats, ids, embed, lm_head, layers=1, kv=HEADS, fc="fc",
                    prefix=lambda i: f"layers.{i}."):
    """EAGLE-1/2: fc over concat(embedding, feature), layers (layer 0 without input
    norm), no final norm, the target's LM head -> (f_hat, logits)."""
    x = torch.cat([embed[ids], feats], -1) @ t[f"{fc}.weight"].T
    if f"{fc}.bias" in t:
        x = x + t[f"{fc}.bias"]
    for i in range(layers):
        x = _llama_layer(x, t, prefix(i), kv, i > 0)
    return x, x @ lm_head.T


# --- import --------------------------------------------------------------------------


@pytest.mark.parametrize("layers,kv,bias,embed,file", [
    (1, HEADS, True, True, "pytorch_model.bin"),
    (2, 2, False, False, "model.safetensors"),  # GQA, no fc bias, the target's embedding
])
def test_eagle_research_checkpoint_computes_what_its_tensors_say(
        tmp_path, target, layers, kv, bias, embed, file):
    folder = tmp_path / "eagle"
    t = write_eagle_research(folder, layers, kv, bias, embed, file)
    assert detect_drafter_format(folder) == "eagle"
    model = load_eagle(folder, target.config, target=target)
    assert (model.meta.input_norm, model.meta.final_norm, model.meta.fc_bias) == (
        False, False, bias)
    feats, ids = torch.randn(2, 7, H), torch.randint(0, V, (2, 7))
    emb = t["embed_tokens.weight"] if embed else target.get_input_embeddings().weight
    want = eagle_reference(t, feats, ids, emb.detach(), target.lm_head.weight.detach(),
                           layers, kv)
    with torch.no_grad():  # float32 rounding is ~1e-5 here; a mapping error is O(1)
        got = model(feats, ids)
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-4)


def test_speculators_checkpoint_computes_what_its_tensors_say(tmp_path, target):
    folder = tmp_path / "spec"
    t = write_speculators(folder)
    assert detect_drafter_format(folder) == "speculators"
    model = load_eagle(folder, target.config, target=target)
    assert model.meta.target_architecture == "LlamaForCausalLM"
    feats, ids = torch.randn(1, 6, H), torch.randint(0, V, (1, 6))
    want = eagle_reference(t, feats, ids, target.get_input_embeddings().weight.detach(),
                           target.lm_head.weight.detach(), fc="fusion_fc",
                           prefix=lambda i: "transformer.")
    with torch.no_grad():
        got = model(feats, ids)
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layers,file", [(1, "medusa_lm_head.safetensors"),
                                         (0, "medusa_lm_head.pt")])
def test_medusa_checkpoint_computes_what_its_tensors_say(tmp_path, target, layers, file):
    folder = tmp_path / "medusa"
    t = write_medusa(folder, 3, layers, file)
    assert detect_drafter_format(folder) == "medusa"
    heads = load_medusa(folder, target, dtype=torch.float64)
    h, t = torch.randn(2, 5, H, dtype=torch.float64), _f64(t)
    with torch.no_grad():
        got = heads(h)
    for k in range(3):
        x = h
        if layers:
            x = h + F.silu(h @ t[f"{k}.0.linear.weight"].T + t[f"{k}.0.linear.bias"])
        torch.testing.assert_close(got[k], x @ t[f"{k}.{layers}.weight"].T, atol=1e-9,
                                   rtol=1e-9)
    assert heads.meta.target == "tiny-target" and heads.meta.fingerprint == ""


# --- refusals ------------------------------------------------------------------------


def test_eagle3_markers_and_unknown_folders_are_refused_naming_file_and_field(tmp_path,
                                                                             tiny_pair):
    """EAGLE-3 folders are recognised (tests/unit/test_drafter_formats_eagle3.py loads
    them); one whose files contradict its markers is refused naming file and field."""
    e3 = tmp_path / "e3"
    write_eagle_research(e3)
    cfg = json.loads((e3 / "config.json").read_text())
    (e3 / "config.json").write_text(json.dumps({**cfg, "draft_vocab_size": 32}))
    assert detect_drafter_format(e3) == "eagle3"
    with pytest.raises(DrafterFormatError, match=r"eagle_model: .*e3/pytorch_model.bin: has "
                       r"no midlayer.\* .*draft_vocab_size=32"):
        load_eagle(e3)
    spec3 = tmp_path / "s3"
    write_speculators(spec3)
    cfg = json.loads((spec3 / "config.json").read_text())
    (spec3 / "config.json").write_text(json.dumps({**cfg, "speculators_model_type": "eagle3"}))
    assert detect_drafter_format(spec3, "eagle_model") == "speculators-eagle3"
    with pytest.raises(DrafterFormatError, match=r"s3/config.json: has no "
                       r"norm_before_residual"):
        load_eagle(spec3)
    d2t = tmp_path / "d2t"
    d2t.mkdir()
    (d2t / "config.json").write_text(json.dumps(_llama_cfg(1, HEADS)))
    save_file({"d2t": torch.zeros(4, dtype=torch.long), "fc.weight": torch.zeros(H, 3 * H)},
              str(d2t / "model.safetensors"))
    assert detect_drafter_format(d2t) == "eagle3"
    with pytest.raises(DrafterFormatError, match=r"d2t/model.safetensors: has no midlayer"):
        load_eagle(d2t)
    with pytest.raises(DrafterFormatError, match=r"medusa_model: .*target/model.safetensors"
                       r": holds no Medusa heads"):
        load_medusa(tiny_pair["target"])
    with pytest.raises(DrafterFormatError, match=r"medusa_model: .*holds an EAGLE drafter "
                       r"\(eagle format\), not Medusa heads"):
        load_medusa(_eagle_folder(tmp_path))


def _eagle_folder(tmp_path):
    folder = tmp_path / "plain-eagle"
    if not folder.exists():
        write_eagle_research(folder)
    return folder


def test_a_drafter_for_another_target_is_refused_before_any_work(tmp_path, target,
                                                                 tiny_pair):
    wide = tmp_path / "wide"
    write_eagle_research(wide, hidden=48)  # its config says 48, the target has 32
    with pytest.raises(DrafterFormatError, match=r"eagle_model: .*wide/config.json: "
                       r"hidden_size=48, but the target has hidden_size=32"):
        load_eagle(wide, target.config, target=target)
    dec = Decoder.from_pretrained(tiny_pair["target"])
    with pytest.raises(ValueError, match=r"wide/config.json: hidden_size=48"):
        dec.generate(prompt_ids=PROMPT, method="eagle", eagle_model=str(wide))
    med = tmp_path / "med"
    write_medusa(med, vocab=80)
    with pytest.raises(DrafterFormatError, match=r"medusa_model: .*med/medusa_lm_head"
                       r".safetensors: 0.1.weight .* has shape \[80, 32\].*vocab_size=64"):
        dec.generate(prompt_ids=PROMPT, method="medusa", medusa_model=str(med),
                     tree="cartesian")
    # without the target (a Serve draft replica) a public EAGLE checkpoint has no LM head
    with pytest.raises(DrafterFormatError, match=r"pytorch_model.bin: has no lm_head.weight"
                       r".*no target was given.*speclab export .* --format speclab"):
        load_eagle(_eagle_folder(tmp_path))


# --- export and back -----------------------------------------------------------------


def _rounds(dec, **knobs):
    """(tokens, per-round accepted lengths) greedy and sampled (short: CI time)."""
    out = []
    for temperature in (0.0, 1.0):
        r = dec.generate(prompt_ids=PROMPT, max_new_tokens=12, temperature=temperature,
                         seed=3, **knobs)
        out.append((r.token_ids, r.stats.accepted_lengths))
    return out


def test_eagle_export_then_import_decodes_identically(tmp_path, tiny_pair, target):
    src = tmp_path / "research"
    write_eagle_research(src, layers=1, embed=False)
    mine = export_drafter(src, "speclab", tmp_path / "mine", target=tiny_pair["target"])
    assert detect_drafter_format(mine) == "speclab-eagle"  # self-contained: no target
    assert load_eagle(mine).meta.input_norm is False
    # speculators dropped its EAGLE-1/2 type (0.9.0 reads eagle3, not eagle): refused
    with pytest.raises(DrafterFormatError, match=r"--format speculators: .*no runtime reads "
                       r"that export; write the EAGLE research layout instead \(--format eagle\)"):
        export_drafter(mine, "speculators", tmp_path / "spec", target=tiny_pair["target"])
    assert not (tmp_path / "spec").exists()
    back = export_drafter(mine, "eagle", tmp_path / "eagle")
    assert detect_drafter_format(back) == "eagle"
    dec = Decoder.from_pretrained(tiny_pair["target"])
    knobs = {"method": "eagle", "depth": 3, "nodes": 6, "tree_top_k": 2}
    base = _rounds(dec, eagle_model=str(mine), **knobs)
    assert any(max(lengths) > 1 for _, lengths in base)  # some drafts are accepted
    for folder in (src, back):
        assert _rounds(dec, eagle_model=str(folder), **knobs) == base, folder.name
    # the research export is what EAGLE's cnets.Model loads strictly
    state = torch.load(back / "pytorch_model.bin", weights_only=True)
    layer0 = {k for k in state if k.startswith("layers.0.")}
    assert "layers.0.input_layernorm.weight" not in layer0 and len(layer0) == 8
    assert {"fc.weight", "fc.bias", "embed_tokens.weight"} <= set(state)
    assert "lm_head.weight" not in state and "norm.weight" not in state


def _dotted(cfg: dict, path: str):
    node = cfg
    for part in path.split("."):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def test_an_old_speculators_eagle_folder_reads_and_moves_to_the_eagle_layout(tmp_path,
                                                                           tiny_pair):
    """speculators_model_type: eagle (speculators before 0.9, which dropped it) is read, and
    written only as the EAGLE research layout: the same drafter, decoding identically."""
    src = tmp_path / "spec-in"
    write_speculators(src)
    assert detect_drafter_format(src) == "speculators"
    with pytest.raises(DrafterFormatError, match="has no embed_tokens.weight: this format "
                       "takes the target's embedding, and no target was given"):
        export_drafter(src, "eagle", tmp_path / "no-target")
    with pytest.raises(DrafterFormatError, match=r"--format speculators: .*speculators_model"
                       r"_type: eagle.*--format eagle"):
        export_drafter(src, "speculators", tmp_path / "spec-out", target=tiny_pair["target"])
    out = export_drafter(src, "eagle", tmp_path / "eagle-out", target=tiny_pair["target"])
    state = torch.load(out / "pytorch_model.bin", weights_only=True)
    assert {"fc.weight", "fc.bias", "embed_tokens.weight"} <= set(state)
    assert "layers.0.input_layernorm.weight" not in state
    from safetensors.torch import load_file

    a = load_file(str(src / "model.safetensors"))
    assert torch.equal(state["fc.bias"], a["fusion_fc.bias"])
    assert torch.equal(state["layers.0.self_attn.q_proj.weight"],
                       a["transformer.self_attn.q_proj.weight"])
    dec = Decoder.from_pretrained(tiny_pair["target"])
    knobs = {"method": "eagle", "depth": 3, "nodes": 6, "tree_top_k": 2}
    assert _rounds(dec, eagle_model=str(out), **knobs) == _rounds(dec, eagle_model=str(src),
                                                                   **knobs)


def test_medusa_export_then_import_decodes_identically(tmp_path, tiny_pair, target):
    torch.manual_seed(0)
    heads = MedusaHeads.from_target(target, tiny_pair["target"], heads=3)
    with torch.no_grad():  # trained-looking heads: some drafts are accepted
        heads.w1.normal_(0, 0.2)
        heads.b1.normal_(0, 0.05)
    mine = save_medusa(heads, tmp_path / "mine", {"accuracies": [[0.5], [0.3], [0.2]]})
    out = export_drafter(mine, "medusa", tmp_path / "medusa")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["medusa_num_heads"] == 3 and cfg["medusa_num_layers"] == 1
    assert cfg["base_model_name_or_path"] == tiny_pair["target"]
    dec = Decoder.from_pretrained(tiny_pair["target"])
    knobs = {"method": "medusa", "tree": "cartesian", "tree_top_k": 2}
    base = _rounds(dec, medusa_model=str(mine), **knobs)
    assert any(max(lengths) > 1 for _, lengths in base)
    assert _rounds(dec, medusa_model=str(out), **knobs) == base
    assert load_medusa(out).tree == {"accuracies": [[0.5], [0.3], [0.2]]}


def test_formats_that_cannot_hold_the_drafter_are_refused_naming_why(tmp_path, target):
    normed = save_eagle(EagleModel.from_target(target), tmp_path / "normed")
    with pytest.raises(DrafterFormatError, match=r"--format eagle: .*input norm in layer "
                       r"0 and a final norm"):
        export_drafter(normed, "eagle", tmp_path / "eagle", target="tiny-target")
    with pytest.raises(DrafterFormatError, match=r"--format speculators: .*--format eagle"):
        export_drafter(normed, "speculators", tmp_path / "speculators", target="tiny-target")
    with pytest.raises(DrafterFormatError, match="'medusa' holds Medusa heads and this is an "
                       "EAGLE drafter"):
        export_drafter(normed, "medusa", tmp_path / "m")
    heads = save_medusa(MedusaHeads.from_target(target, "t", 2), tmp_path / "heads")
    with pytest.raises(DrafterFormatError, match="'speculators' holds EAGLE drafters"):
        export_drafter(heads, "speculators", tmp_path / "s")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(DrafterFormatError, match="--out: .*busy exists and is not an empty"):
        export_drafter(heads, "medusa", tmp_path / "busy")
    # what a training job checks before any work: its drafter's meta against output.export
    check_exports(["eagle"], EagleMeta.for_target(target.config, 1, False, False))
    with pytest.raises(DrafterFormatError, match="output.export: 'speculators' cannot hold "
                       "the drafter this job trains: speculators removed its EAGLE-1/2"):
        check_exports(["speculators"], EagleMeta.for_target(target.config, 1, False, False))
    with pytest.raises(DrafterFormatError, match="output.export: 'eagle' cannot hold "
                       "the drafter this job trains: the drafter has an input norm"):
        check_exports(["eagle"], EagleMeta.for_target(target.config))
    with pytest.raises(DrafterFormatError, match="output.export: 'eagle' cannot hold"):
        check_exports(["medusa", "eagle"], MedusaMeta("t", "", H, V))


def test_a_speclab_drafter_in_eagle1_layout_has_no_norm_weights(target):
    model = EagleModel.from_target(target, 2, input_norm=False, final_norm=False)
    names = set(model.state_dict())
    assert "decoder.norm.weight" not in names
    assert "decoder.layers.0.input_layernorm.weight" not in names
    assert "decoder.layers.1.input_layernorm.weight" in names
    # a config.json without the layout keys (saved before them) is today's layout
    assert EagleMeta(target_architecture="X", hidden_size=H, vocab_size=V).input_norm is True


def test_the_target_for_another_hidden_size_is_refused_for_speculators(tmp_path):
    other = load_model(str(build_tiny_llama(tmp_path / "other", seed=4, vocab_size=V,
                                            hidden_size=48)))
    spec = tmp_path / "spec"
    write_speculators(spec)
    with pytest.raises(DrafterFormatError, match=r"spec/config.json: transformer_layer_config"
                       r".hidden_size=32, but the target has hidden_size=48"):
        load_eagle(spec, other.config, target=other)


def test_training_jobs_export_and_log_the_final_drafter(tmp_path, tiny_pair, target):
    from speclab.config.schema import OutputConfig
    from speclab.pipelines.export import export_final

    assert OutputConfig(export=["medusa"]).export == ["medusa"]
    with pytest.raises(ValueError, match="each format at most once"):
        OutputConfig(export=["eagle", "eagle"])
    with pytest.raises(ValueError, match="export.0"):
        OutputConfig(export=["eagle3"])

    class Tracker:  # the interface export_final uses: log_artifacts(folder, path)
        def __init__(self):
            self.logged = []

        def log_artifacts(self, folder, path):
            self.logged.append((folder, path, sorted(p.name for p in Path(folder).iterdir())))

    folder = save_medusa(MedusaHeads.from_target(target, tiny_pair["target"], 2),
                         tmp_path / "run" / "medusa")
    t = Tracker()
    outs = export_final(["medusa"], folder, tiny_pair["target"], t, "train_medusa")
    assert outs == [tmp_path / "run" / "medusa-medusa"]
    assert t.logged == [(str(outs[0]), "export/medusa",
                         ["config.json", "medusa_lm_head.pt", "medusa_lm_head.safetensors"])]
    assert export_final([], folder, tiny_pair["target"], t, "train_medusa") == []


def test_a_serve_draft_replica_loads_public_drafters_or_says_how(tmp_path, tiny_pair):
    """The draft replica holds no target weights: a Medusa-format folder (self-contained)
    loads as it is; a public EAGLE checkpoint is refused with the conversion command, and
    its converted speclab folder loads and is checked against the target."""
    from serve_apps.draft import DraftDeployment

    med = tmp_path / "med"
    write_medusa(med)
    method = {"name": "medusa", "medusa_model": str(med), "tree": "cartesian"}
    assert DraftDeployment(None, None, method, V, target_source=tiny_pair["target"]).features
    with pytest.raises(ValueError, match="medusa_model: heads trained for a target with "
                                         "vocab_size=64, but the target has 100"):
        DraftDeployment(None, None, method, 100)
    spec = tmp_path / "spec"
    write_speculators(spec)
    with pytest.raises(DrafterFormatError, match=r"eagle_model: .*spec/model.safetensors: has "
                       r"no embed_tokens.weight.*speclab export .*spec --format speclab"):
        DraftDeployment(None, None, {"name": "eagle", "eagle_model": str(spec)}, V)
    mine = export_drafter(spec, "speclab", tmp_path / "mine", target=tiny_pair["target"])
    eagle = {"name": "eagle", "eagle_model": str(mine)}
    assert DraftDeployment(None, None, eagle, V, target_source=tiny_pair["target"]).features
    cfg = json.loads((mine / "config.json").read_text())
    assert cfg["imported_from"]["format"] == "speculators"
    assert cfg["target_architecture"] == "LlamaForCausalLM"


def test_speclab_export_command(tmp_path, tiny_pair, target, capsys):
    from speclab.cli import main

    src = tmp_path / "research"
    write_eagle_research(src)
    assert main(["export", str(src), "--format", "speculators", "--out",
                 str(tmp_path / "spec"), "--target", tiny_pair["target"]]) == 2
    assert "--format eagle" in capsys.readouterr().err
    out = tmp_path / "eagle-out"
    assert main(["export", str(src), "--format", "eagle", "--out", str(out),
                 "--target", tiny_pair["target"]]) == 0
    assert "SGLang" in capsys.readouterr().out
    assert (out / "pytorch_model.bin").exists()
    normed = save_eagle(EagleModel.from_target(target), tmp_path / "normed")
    assert main(["export", str(normed), "--format", "eagle", "--out",
                 str(tmp_path / "e")]) == 2
    assert "error: --format eagle: cannot write" in capsys.readouterr().err


def test_a_drafter_trained_with_eagle1_layout_exports_and_round_trips(tmp_path, tiny_pair):
    """``eagle.norms: false``: the training task builds the EAGLE-1/2 layout, whose saved
    drafter the speculators and EAGLE formats hold; export then import decodes with the
    same accepted lengths, greedy and sampled."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from speclab.config.schema import EagleTrainConfig, TrainConfig
    from speclab.decoding.runner import ModelRunner
    from speclab.families.eagle.task import EagleTask, EagleTaskConfig
    from speclab.train.distill_data import feat_example

    runner = ModelRunner(load_model(tiny_pair["target"]))
    (tmp_path / "data" / "feat").mkdir(parents=True)
    for i in range(2):  # the task reads its data's shape from two feature shards
        pq.write_table(pa.Table.from_pylist([feat_example(runner, list(range(1, 18)), 4)]),
                       tmp_path / "data" / "feat" / f"shard-{i:05d}.parquet")
    cfg = EagleTaskConfig(train=TrainConfig(batch_size=2), eagle=EagleTrainConfig(norms=False),
                          target=tiny_pair["target"])
    model = EagleTask(cfg, tmp_path / "data", torch.device("cpu")).build_model()
    assert model.meta.input_norm is False and model.meta.final_norm is False
    check_exports(["eagle"], model.meta)
    mine = save_eagle(model, tmp_path / "trained")
    back = export_drafter(mine, "eagle", tmp_path / "eagle")
    dec = Decoder.from_pretrained(tiny_pair["target"])
    knobs = {"method": "eagle", "depth": 3, "nodes": 6, "tree_top_k": 2}
    base = _rounds(dec, eagle_model=str(mine), **knobs)
    assert _rounds(dec, eagle_model=str(back), **knobs) == base

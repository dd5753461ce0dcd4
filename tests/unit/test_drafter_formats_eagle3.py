"""EAGLE-3 drafters in and out (issue 36): tiny checkpoints written from the public
EAGLE-3 formats' key names and config fields (the EAGLE authors' research code,
SpecForge's output, speculators ``eagle3``) load to drafters whose outputs equal a direct
float64 computation written from the file's tensors; their target layers come from the
config (vLLM's ``eagle_aux_hidden_state_layer_ids``: the input of decoder layer i;
SpecForge / SGLang's ``eagle_config``: the output of layer i) or EAGLE-3's default; an
export to either format and back gives the same state dict and decodes with the same
per-round accepted lengths; variants speclab does not compute and drafters for another
target are refused naming the file and the field."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from speclab.api import Decoder
from speclab.families.eagle.model import load_eagle, save_eagle
from speclab.families.eagle.model3 import Eagle3Model
from speclab.models.formats import (
    VLLM_READS_EAGLE3,
    DrafterFormatError,
    check_exports,
    detect_drafter_format,
    drafter_feature_spec,
    export_drafter,
)
from speclab.models.loading import load_model
from speclab.models.tiny import build_tiny_llama

PROMPT = [3, 9, 27, 17, 51, 2]
H, V, HEADS, INTER, LAYERS = 32, 100, 4, 64, 8  # the tiny target (8 layers: (2, 4, 5))
DEFAULT = (2, 4, 5)  # EAGLE-3's (2, L // 2, L - 3) for L = 8
VD = 40  # the draft vocabulary of the checkpoints below


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return str(build_tiny_llama(tmp_path_factory.mktemp("e3") / "target", seed=11,
                                vocab_size=V, hidden_size=H, num_layers=LAYERS))


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(target_dir)


# --- public checkpoints, from the formats' key names ---------------------------------


def _rand(g: torch.Generator, *shape: int, scale: float = 0.3) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * scale


def eagle3_tensors(prefix: str, kv: int = HEADS, vd: int = VD, k: int = 3,
                   embed: bool = True, seed: int = 0) -> dict:
    """An EAGLE-3 drafter's tensors: fc over k target states, one layer under ``prefix``
    (q/k/v read 2H), final norm, LM head over the draft vocabulary, d2t / t2d."""
    g = torch.Generator().manual_seed(seed)
    hd = H // HEADS
    t = {"fc.weight": _rand(g, H, k * H, scale=0.2)}
    t.update({f"{prefix}self_attn.q_proj.weight": _rand(g, HEADS * hd, 2 * H),
              f"{prefix}self_attn.k_proj.weight": _rand(g, kv * hd, 2 * H),
              f"{prefix}self_attn.v_proj.weight": _rand(g, kv * hd, 2 * H),
              f"{prefix}self_attn.o_proj.weight": _rand(g, H, HEADS * hd),
              f"{prefix}mlp.gate_proj.weight": _rand(g, INTER, H),
              f"{prefix}mlp.up_proj.weight": _rand(g, INTER, H),
              f"{prefix}mlp.down_proj.weight": _rand(g, H, INTER)})
    for norm in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
        t[f"{prefix}{norm}.weight"] = 1 + _rand(g, H, scale=0.1)
    t["norm.weight"] = 1 + _rand(g, H, scale=0.1)
    t["lm_head.weight"] = _rand(g, vd, H, scale=1.0)
    ids = torch.randperm(V, generator=g)[:vd].sort().values  # draft id i -> target ids[i]
    t["d2t"] = ids - torch.arange(vd)
    t["t2d"] = torch.zeros(V, dtype=torch.bool)
    t["t2d"][ids] = True
    if embed:
        t["embed_tokens.weight"] = _rand(g, V, H, scale=1.0)
    return t


def _llama_cfg(kv: int = HEADS, hidden: int = H) -> dict:
    return {"model_type": "llama", "hidden_size": hidden, "intermediate_size": INTER,
            "num_attention_heads": HEADS, "num_key_value_heads": kv, "num_hidden_layers": 1,
            "vocab_size": V, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "rope_scaling": None, "max_position_embeddings": 512, "hidden_act": "silu"}


def write_research(folder, kv=HEADS, embed=True, file="pytorch_model.bin", seed=0,
                   extra=None, tensors=None) -> dict:
    """An EAGLE-3 checkpoint as the EAGLE authors' cnets.Model (embed_tokens included,
    pytorch_model.bin) or SpecForge's LlamaForCausalLMEagle3 (no embedding,
    model.safetensors) saves it."""
    t = tensors or eagle3_tensors("midlayer.", kv, embed=embed, seed=seed)
    cfg = {**_llama_cfg(kv), "architectures": ["LlamaForCausalLMEagle3"],
           "draft_vocab_size": int(t["lm_head.weight"].shape[0]), **(extra or {})}
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    if file.endswith(".safetensors"):
        save_file(t, str(folder / file))
    else:
        torch.save(t, folder / file)
    return t


def write_speculators3(folder, kv=HEADS, embed=False, seed=1, extra=None,
                       verifier="tiny-target", drop=()) -> dict:
    """A speculators ``eagle3`` checkpoint: Eagle3SpeculatorConfig's fields and
    Eagle3DraftModel's tensor names (layers.0.*, no embedding by default)."""
    t = eagle3_tensors("layers.0.", kv, embed=embed, seed=seed)
    cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
           "speculators_version": "0.3.0", "transformer_layer_config": _llama_cfg(kv),
           "draft_vocab_size": VD, "norm_before_residual": False, "norm_before_fc": False,
           "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": [5, 2, 4],
           "speculators_config": {
               "algorithm": "eagle3", "default_proposal_method": "greedy",
               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
               "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]}},
           **(extra or {})}
    for key in drop:
        cfg.pop(key)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(t, str(folder / "model.safetensors"))
    return t


# --- the reference computation, from the raw tensors (float64) -----------------------


def _rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, theta=10000.0):  # x [B, heads, T, hd], positions 0..T-1
    hd, n = x.shape[-1], x.shape[-2]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    rot = torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1)
    return x * cos + rot * sin


def eagle3_reference(t, p, feats, ids, embed, kv=HEADS):
    """EAGLE-3, written out: h = fc(states); x = [input_norm(Embed), hidden_norm(h)]
    (embedding first); causal attention with RoPE over x; residual on h; MLP block;
    logits = lm_head(norm(out)) scattered to target ids (draft id i -> i + d2t[i])."""
    t = {k: (v.double() if v.is_floating_point() else v) for k, v in t.items()}
    b, n, _ = feats.shape
    hd = H // HEADS
    h = feats @ t["fc.weight"].T
    x = torch.cat([_rms(embed[ids], t[p + "input_layernorm.weight"]),
                   _rms(h, t[p + "hidden_norm.weight"])], -1)
    q = (x @ t[p + "self_attn.q_proj.weight"].T).view(b, n, HEADS, hd).transpose(1, 2)
    k = (x @ t[p + "self_attn.k_proj.weight"].T).view(b, n, kv, hd).transpose(1, 2)
    v = (x @ t[p + "self_attn.v_proj.weight"].T).view(b, n, kv, hd).transpose(1, 2)
    k, v = k.repeat_interleave(HEADS // kv, 1), v.repeat_interleave(HEADS // kv, 1)
    q, k = _rope(q), _rope(k)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
    att = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, HEADS * hd)
    h = h + att @ t[p + "self_attn.o_proj.weight"].T
    m = _rms(h, t[p + "post_attention_layernorm.weight"])
    out = h + (F.silu(m @ t[p + "mlp.gate_proj.weight"].T)
               * (m @ t[p + "mlp.up_proj.weight"].T)) @ t[p + "mlp.down_proj.weight"].T
    draft = _rms(out, t["norm.weight"]) @ t["lm_head.weight"].T
    return out, draft, torch.arange(draft.shape[-1]) + t["d2t"]


def _check_computes(model, t, prefix, embed, kv):
    feats = torch.randn(2, 7, 3 * H, dtype=torch.float64)
    ids = torch.randint(0, V, (2, 7))
    want_out, want_draft, where = eagle3_reference(t, prefix, feats, ids, embed.double(), kv)
    with torch.no_grad():  # the norms compute in float32: ~1e-6; a mapping error is O(1)
        out, logits = model(feats, ids)
    torch.testing.assert_close(out, want_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(logits[..., where], want_draft, atol=2e-5, rtol=2e-5)
    outside = torch.ones(V, dtype=torch.bool)
    outside[where] = False
    assert bool((logits[..., outside] == torch.finfo(logits.dtype).min).all())


# --- import --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["eagle-code", "specforge"])
def test_eagle3_research_checkpoint_computes_what_its_tensors_say(tmp_path, target, kind):
    folder = tmp_path / kind
    if kind == "eagle-code":  # embedding in the file, pytorch_model.bin, default layers
        t = write_research(folder)
        layers, embed = DEFAULT, t["embed_tokens.weight"]
        assert drafter_feature_spec(folder) == "eagle3"
    else:  # SpecForge: no embedding, safetensors, GQA, layers named as layer OUTPUTS
        t = write_research(folder, kv=2, embed=False, file="model.safetensors",
                           extra={"eagle_config": {"eagle_aux_hidden_state_layer_ids":
                                                   [1, 4, 6]}})
        layers, embed = (2, 5, 7), target.get_input_embeddings().weight.detach()
        assert drafter_feature_spec(folder) == layers  # output of layer i = input of i + 1
    assert detect_drafter_format(folder) == "eagle3"
    model = load_eagle(folder, target.config, dtype=torch.float64, target=target)
    assert isinstance(model, Eagle3Model)
    assert (model.meta.version, model.meta.feature_layers, model.meta.draft_vocab_size,
            model.meta.fc_bias) == (3, layers, VD, False)
    _check_computes(model, t, "midlayer.", embed, 2 if kind == "specforge" else HEADS)


def test_speculators_eagle3_checkpoint_computes_what_its_tensors_say(tmp_path, target):
    folder = tmp_path / "spec3"
    t = write_speculators3(folder, kv=2)
    assert detect_drafter_format(folder) == "speculators-eagle3"
    assert drafter_feature_spec(folder) == (2, 4, 5)  # [5, 2, 4]: vLLM captures ascending
    model = load_eagle(folder, target.config, dtype=torch.float64, target=target)
    assert model.meta.feature_layers == (2, 4, 5)
    assert model.meta.target_architecture == "LlamaForCausalLM"
    _check_computes(model, t, "layers.0.", target.get_input_embeddings().weight.detach(), 2)


# --- export and back -----------------------------------------------------------------


def _rounds(dec, folder):
    """(tokens, per-round accepted lengths), greedy and sampled."""
    out = []
    for temperature in (0.0, 1.0):
        r = dec.generate(prompt_ids=PROMPT, max_new_tokens=12, temperature=temperature,
                         seed=3, method="eagle", eagle_model=str(folder), depth=3, nodes=6,
                         tree_top_k=2)
        out.append((r.token_ids, r.stats.accepted_lengths))
    return out


def _same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def test_eagle3_export_then_import_is_the_same_drafter(tmp_path, target, target_dir):
    torch.manual_seed(0)
    model = Eagle3Model.from_target(target, draft_ids=torch.arange(0, V, 2))
    check_exports(["speculators", "eagle"], model.meta, target_config=target.config)
    mine = save_eagle(model, tmp_path / "mine")
    spec = export_drafter(mine, "speculators", tmp_path / "spec", target=target_dir,
                          speculative_tokens=4)
    research = export_drafter(mine, "eagle", tmp_path / "eagle")
    assert detect_drafter_format(spec) == "speculators-eagle3"
    assert detect_drafter_format(research) == "eagle3"
    for folder in (spec, research):
        back = load_eagle(folder)  # self-contained: embedding and layers in the files
        _same_state(back, model)
        assert back.meta.feature_layers == model.meta.feature_layers == DEFAULT
        assert drafter_feature_spec(folder) == DEFAULT
    assert load_eagle(spec).meta == model.meta  # the verifier's architecture comes back
    # and a public EAGLE-3 source exports too (to speclab's folder and back to public)
    again = export_drafter(spec, "speclab", tmp_path / "again", target=target_dir)
    _same_state(load_eagle(again), model)
    dec = Decoder.from_pretrained(target_dir)
    base = _rounds(dec, mine)
    assert any(max(lengths) > 1 for _, lengths in base)  # some drafts are accepted
    for folder in (spec, research, again):
        assert _rounds(dec, folder) == base, folder.name
    # what the EAGLE code's cnets.Model loads strictly
    state = torch.load(research / "pytorch_model.bin", weights_only=True)
    assert set(state) == {"embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight",
                          "d2t", "t2d"} | {k for k in state if k.startswith("midlayer.")}
    assert len([k for k in state if k.startswith("midlayer.")]) == 10
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    cfg = json.loads((research / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 50
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM: layer inputs
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # outputs


def test_full_vocabulary_and_the_eagle_codes_untouched_t2d(tmp_path, target, target_dir):
    """draft_vocab_size = vocab_size: d2t zero, and the EAGLE code leaves t2d all false."""
    t = eagle3_tensors("midlayer.", vd=V)
    t["d2t"], t["t2d"] = torch.zeros(V, dtype=torch.long), torch.zeros(V, dtype=torch.bool)
    folder = tmp_path / "full"
    write_research(folder, tensors=t)
    model = load_eagle(folder, target.config, target=target)
    assert model.meta.draft_vocab_size == 0 and bool(model.t2d.all())
    out = export_drafter(folder, "speculators", tmp_path / "spec", target=target_dir)
    _same_state(load_eagle(out), model)
    t["d2t"][3], t["d2t"][4] = 1, -1  # target ids 3 and 4 swapped
    bad = tmp_path / "perm"
    write_research(bad, tensors=t)
    with pytest.raises(DrafterFormatError, match=r"perm/pytorch_model.bin: d2t permutes "
                       r"the full vocabulary"):
        load_eagle(bad, target.config, target=target)


def test_the_speculators_eagle3_export_carries_what_vllm_reads(tmp_path, target_dir):
    src = tmp_path / "spec-in"
    write_speculators3(src, embed=True)
    out = export_drafter(src, "speculators", tmp_path / "spec-out", target=target_dir)
    cfg = json.loads((out / "config.json").read_text())
    for path in VLLM_READS_EAGLE3:
        node = cfg
        for part in path.split("."):
            node = node[int(part)] if isinstance(node, list) else node[part]
    assert "model_type" not in cfg and cfg["speculators_model_type"] == "eagle3"
    assert cfg["norm_before_residual"] is False  # vLLM reads an absent one as true
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["transformer_layer_config"]["vocab_size"] == V and cfg["draft_vocab_size"] == VD
    from safetensors.torch import load_file

    a, b = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- refusals ------------------------------------------------------------------------


def test_variants_speclab_does_not_compute_are_refused_by_name(tmp_path, target):
    cases = [({}, ("norm_before_residual",), r"config.json: has no norm_before_residual: "
                                             r"speculators reads that as false and vLLM as"),
             ({"norm_before_fc": True, "fc_norm": True}, (),
              r"config.json: norm_before_fc=true and fc_norm=true: speculators refuses"),
             ({"norm_output": "yes"}, (), r"config.json: norm_output='yes': true or false"),
             ({"target_hidden_size": 64}, (), r"config.json: target_hidden_size=64, but the "
                                              r"target has hidden_size=32"),
             ({"eagle_aux_hidden_state_layer_ids": [2, 4, 8]}, (),
              r"config.json: names target layers \[8\] .* the target has 8 decoder layers"),
             ({"eagle_aux_hidden_state_layer_ids": [2, 2, 5]}, (),
              r"config.json: eagle_aux_hidden_state_layer_ids=\[2, 2, 5\]: repeated")]
    for i, (extra, drop, message) in enumerate(cases):
        folder = tmp_path / f"v{i}"
        write_speculators3(folder, extra=extra, drop=drop)
        with pytest.raises(DrafterFormatError, match=rf"eagle_model: .*v{i}/{message}"):
            load_eagle(folder, target.config, target=target)
    for flag in ("norm_before_residual", "norm_before_fc"):  # not the EAGLE code's
        research = tmp_path / f"research-{flag}"
        write_research(research, extra={flag: True})
        with pytest.raises(DrafterFormatError, match=rf"research-{flag}/config.json: "
                           rf"{flag}=true: .* neither the EAGLE code nor SpecForge"):
            load_eagle(research, target.config, target=target)
    mixed = tmp_path / "mixed"
    write_research(mixed, extra={"eagle_aux_hidden_state_layer_ids": [2, 4, 5],
                                 "eagle_config": {"eagle_aux_hidden_state_layer_ids":
                                                  [2, 4, 5]}})
    with pytest.raises(DrafterFormatError, match=r"mixed/config.json: .*\[2, 4, 5\] \(the "
                       r"input .*\[2, 4, 5\] \(the output .* name different target states"):
        load_eagle(mixed, target.config, target=target)


def test_shapes_are_checked_against_the_target_naming_file_and_field(tmp_path, target,
                                                                     target_dir):
    def research(name, edit=None, **kw):
        t = eagle3_tensors("midlayer.")
        if edit:
            edit(t)
        write_research(tmp_path / name, tensors=t, **kw)
        return tmp_path / name

    wide = research("wide", extra={"hidden_size": 48})  # the config says 48, the target 32
    with pytest.raises(DrafterFormatError, match=r"wide/config.json: hidden_size=48, but the "
                       r"target has hidden_size=32"):
        load_eagle(wide, target.config, target=target)
    spec = tmp_path / "spec"
    write_speculators3(spec, extra={"transformer_layer_config": {**_llama_cfg(),
                                                                  "vocab_size": 120}})
    with pytest.raises(DrafterFormatError, match=r"spec/config.json: transformer_layer_config"
                       r".vocab_size=120, but the target has vocab_size=100"):
        load_eagle(spec, target.config, target=target)
    cases = {
        "d2t": (lambda t: t.update(d2t=t["d2t"][:-1]),
                r"pytorch_model.bin: d2t has shape \[39\], expected \[40\]"),
        "t2d": (lambda t: t.update(t2d=t["t2d"][:-1]),
                r"pytorch_model.bin: t2d has shape \[99\], expected \[100\]"),
        "fc": (lambda t: t.update({"fc.weight": t["fc.weight"][:, :-3]}),
               r"pytorch_model.bin: fc.weight has shape \[32, 93\], expected \[32, k \* 32\]"),
        "fc2": (lambda t: t.update({"fc.weight": t["fc.weight"][:, :64]}),
                r"pytorch_model.bin: fc.weight fuses 2 target states, but the drafter reads "
                r"3 target layers \[2, 4, 5\]"),
        "head": (lambda t: t.update({"lm_head.weight": t["lm_head.weight"][:30]}),
                 r"pytorch_model.bin: lm_head.weight has 30 rows, but config.json has "
                 r"draft_vocab_size=40"),
        "q": (lambda t: t.update({"midlayer.self_attn.q_proj.weight":
                                  t["midlayer.self_attn.q_proj.weight"][:, :H]}),
              r"pytorch_model.bin: midlayer.self_attn.q_proj.weight has shape \[32, 32\], "
              r"expected \[32, 64\]"),
        "maps": (lambda t: t["t2d"].logical_not_(),
                 r"pytorch_model.bin: t2d does not mark the target ids d2t maps"),
        "extra": (lambda t: t.update({"midlayer.extra.weight": torch.ones(2)}),
                  r"pytorch_model.bin: holds tensors an EAGLE-3 drafter .* does not have: "
                  r"\['midlayer.extra.weight'\]"),
    }
    for name, (edit, message) in cases.items():
        folder = research(name, edit, extra={"draft_vocab_size": VD})
        with pytest.raises(DrafterFormatError, match=rf"eagle_model: .*{name}/{message}"):
            load_eagle(folder, target.config, target=target)
    # EAGLE-3's default for a 6-layer target repeats layer 3: no public code computes that
    shallow = load_model(str(build_tiny_llama(tmp_path / "shallow", seed=2, vocab_size=V,
                                              hidden_size=H, num_layers=6)))
    with pytest.raises(DrafterFormatError, match=r"names no target layers, and EAGLE-3's "
                       r"default for a target of 6 layers, .* = \(2, 3, 3\), repeats"):
        load_eagle(research("six"), shallow.config, target=shallow)
    # without a target: no default layers, no embedding (a Serve draft replica)
    with pytest.raises(DrafterFormatError, match=r"six/config.json: names no target layers "
                       r".* no target was given .*speclab export .* --format speclab"):
        load_eagle(tmp_path / "six")
    named = tmp_path / "named"
    write_speculators3(named)
    with pytest.raises(DrafterFormatError, match=r"named/model.safetensors: has no "
                       r"embed_tokens.weight: this checkpoint takes the target's embedding"):
        load_eagle(named)
    # the Decoder refuses a drafter for another target before decoding
    dec = Decoder.from_pretrained(target_dir)
    with pytest.raises(ValueError, match=r"wide/config.json: hidden_size=48"):
        dec.generate(prompt_ids=PROMPT, method="eagle", eagle_model=str(wide))


def test_formats_that_cannot_hold_an_eagle3_drafter_are_refused_naming_why(tmp_path, target,
                                                                          target_dir):
    from dataclasses import replace

    base = Eagle3Model.from_target(target).meta
    for meta, why in [(replace(base, fc_bias=True), "fc has a bias"),
                      (replace(base, feature_layers=(2, 4)), "fuses 2 target layers"),
                      (replace(base, feature_layers=(5, 2, 4)), "not strictly ascending"),
                      (replace(base, embed_scale=2.0), "scales the token embedding")]:
        for fmt in ("speculators", "eagle"):
            with pytest.raises(DrafterFormatError, match=rf"output.export: '{fmt}' cannot "
                               rf"hold the drafter this job trains: .*{why}"):
                check_exports([fmt], meta)
    final = replace(base, feature_layers=(2, 4, LAYERS))  # speclab's index L: final norm
    check_exports(["speculators"], final)  # the target's depth unknown: not checkable
    with pytest.raises(DrafterFormatError, match=r"include 8, the target's final norm "
                       r"output"):
        check_exports(["eagle"], final, target_config=target.config)
    folder = save_eagle(Eagle3Model(final), tmp_path / "final")
    with pytest.raises(DrafterFormatError, match=r"--format speculators: cannot write .*"
                       r"include 8"):
        export_drafter(folder, "speculators", tmp_path / "out", target=target_dir)
    with pytest.raises(DrafterFormatError, match="'medusa' holds Medusa heads and this is "
                       "an EAGLE drafter"):
        export_drafter(folder, "medusa", tmp_path / "m")

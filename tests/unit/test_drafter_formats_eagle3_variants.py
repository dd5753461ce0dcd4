"""EAGLE-3 variants in (issue 57): speculators-trained drafters (``norm_before_residual``,
``norm_before_fc``), EAGLE-3.1 (speculators' ``fc_norm`` + ``norm_output``: the normed
state fed back; SpecForge's ``fc_norm`` + ``norm_output``: THERE the final norm before
the LM head), full-vocabulary checkpoints without ``d2t`` / ``t2d``, a research config
whose ``num_hidden_layers`` the EAGLE code ignores, ``target_hidden_size`` other than the
drafter's width, and ``attention_bias``. Each tiny checkpoint is written in its public
layout and the loaded drafter's logits (and the state fed back at depth 2) are compared
with a float64 forward written here from the public code's math (speculators'
``Eagle3DraftModel`` / ``Eagle3FirstLayerMixin``, SpecForge's ``LlamaForCausalLMEagle3``,
vLLM's ``llama_eagle3.py``, EAGLE's ``cnets.py``); greedy decoding with each equals plain
decoding; variants no speclab drafter computes are refused naming the flag; exports
carry the flags back and refuse what their format cannot hold."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from speclab.api import Decoder
from speclab.families.eagle.model import load_eagle
from speclab.models.formats import DrafterFormatError, check_exports, export_drafter
from speclab.models.loading import load_model
from speclab.models.tiny import build_tiny_llama
from tests.unit.test_drafter_formats_eagle3 import (
    HEADS,
    INTER,
    LAYERS,
    PROMPT,
    VD,
    H,
    V,
    _llama_cfg,
    _rms,
    _rope,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models on a shared 2-core machine: one thread (idle OpenMP threads spin)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return str(build_tiny_llama(tmp_path_factory.mktemp("e3v") / "target", seed=11,
                                vocab_size=V, hidden_size=H, num_layers=LAYERS))


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(target_dir)


# --- checkpoints in the public layouts ------------------------------------------------


def variant_tensors(prefix: str, hd: int = H, th: int = H, vd: int = VD, bias: str = "",
                    fc_norm: bool = False, input_norm: bool = False, embed: bool = True,
                    maps: bool = True, seed: int = 0) -> dict:
    """An EAGLE-3 drafter's tensors under the public names: drafter width ``hd``, fused
    target states of width ``th``, ``bias`` "" / "qkv" / "qkvo" attention biases,
    SpecForge's / speculators' ``fc_norm.{i}``, speculators' ``input_norm``."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale

    d = hd // HEADS
    t = {"fc.weight": rand(hd, 3 * th, scale=0.2)}
    for name, rows in (("q", HEADS * d), ("k", HEADS * d), ("v", HEADS * d)):
        t[f"{prefix}self_attn.{name}_proj.weight"] = rand(rows, 2 * hd)
        if bias:
            t[f"{prefix}self_attn.{name}_proj.bias"] = rand(rows)
    t[f"{prefix}self_attn.o_proj.weight"] = rand(hd, HEADS * d)
    if bias == "qkvo":
        t[f"{prefix}self_attn.o_proj.bias"] = rand(hd)
    t.update({f"{prefix}mlp.gate_proj.weight": rand(INTER, hd),
              f"{prefix}mlp.up_proj.weight": rand(INTER, hd),
              f"{prefix}mlp.down_proj.weight": rand(hd, INTER)})
    for norm in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
        t[f"{prefix}{norm}.weight"] = 1 + rand(hd, scale=0.1)
    t["norm.weight"] = 1 + rand(hd, scale=0.1)
    t["lm_head.weight"] = rand(vd, hd, scale=0.1)  # logits O(10): float32 norms ~1e-6
    if maps:
        ids = torch.randperm(V, generator=g)[:vd].sort().values
        t["d2t"] = ids - torch.arange(vd)
        t["t2d"] = torch.zeros(V, dtype=torch.bool)
        t["t2d"][ids] = True
    if fc_norm:
        t.update({f"fc_norm.{i}.weight": 1 + rand(th, scale=0.3) for i in range(3)})
    if input_norm:
        t["input_norm.weight"] = 1 + rand(3 * th, scale=0.3)
    if embed:
        t["embed_tokens.weight"] = rand(V, hd, scale=1.0)
    return t


def speculators3(folder, t: dict, layer=None, **fields) -> dict:
    """A speculators ``eagle3`` folder: Eagle3SpeculatorConfig's fields (0.9.0)."""
    cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
           "transformer_layer_config": layer or _llama_cfg(),
           "draft_vocab_size": int(t["lm_head.weight"].shape[0]),
           "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False,
           "norm_output": False, "target_hidden_size": None,
           "eagle_aux_hidden_state_layer_ids": [2, 4, 5],
           "speculators_config": {
               "algorithm": "eagle3", "default_proposal_method": "greedy",
               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
               "verifier": {"name_or_path": "tiny-target",
                            "architectures": ["LlamaForCausalLM"]}},
           **fields}
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(t, str(folder / "model.safetensors"))
    return cfg


def research3(folder, t: dict, **fields) -> dict:
    """An EAGLE-3 research / SpecForge folder (``LlamaForCausalLMEagle3``'s config)."""
    cfg = {**_llama_cfg(), "architectures": ["LlamaForCausalLMEagle3"],
           "draft_vocab_size": int(t["lm_head.weight"].shape[0]), **fields}
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(t, str(folder / "model.safetensors"))
    return cfg


# --- the reference forward, from the public code's math (float64) --------------------


def reference(t, p, feats, ids, embed, fed_ids=None, *, hd=H, residual_norm=False,
              input_norm=False, fc_norm=False, spec_norm_output=False, head_norm=True):
    """``feats [B, n, 3*H_t]``, ``ids [B, n]`` -> (draft logits ``[B, n(+1), V_d]``, the
    state fed back ``[B, n, H]``). With ``fed_ids [B]``: one more step at position n whose
    hidden input is the state fed back at position n - 1 (depth 2), attending to all.

    fuse (speculators Eagle3DraftModel.forward / vLLM combine_hidden_states / SpecForge
    project_hidden_states): input_norm over the concat, or one fc_norm per state, then fc.
    Layer (speculators Eagle3FirstLayerMixin.forward): residual = h, or hidden_norm(h)
    with norm_before_residual; x = [input_layernorm(emb), hidden_norm(h)]; h' = residual +
    o_proj(attn(x)); out = h' + mlp(post_attention_layernorm(h')). Output: speculators'
    norm_output feeds norm(out) back and the LM head reads it; else out is fed back and
    the head reads norm(out) (SpecForge compute_logits: out itself with norm_output
    false)."""
    t = {k: (v.double() if v.is_floating_point() else v) for k, v in t.items()}
    embed = embed.double()
    g = feats
    if input_norm:
        g = _rms(g, t["input_norm.weight"])
    if fc_norm:
        g = torch.cat([_rms(c, t[f"fc_norm.{i}.weight"])
                       for i, c in enumerate(g.chunk(3, -1))], -1)
    h = g @ t["fc.weight"].T

    def layer(h, tokens):
        b, n, _ = h.shape
        d = hd // HEADS
        normed = _rms(h, t[p + "hidden_norm.weight"])
        x = torch.cat([_rms(embed[tokens], t[p + "input_layernorm.weight"]), normed], -1)

        def proj(name):
            y = x @ t[f"{p}self_attn.{name}_proj.weight"].T
            bias = t.get(f"{p}self_attn.{name}_proj.bias")
            return (y if bias is None else y + bias).view(b, n, HEADS, d).transpose(1, 2)

        q, k, v = _rope(proj("q")), _rope(proj("k")), proj("v")
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)
        scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
        att = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, HEADS * d)
        o = att @ t[p + "self_attn.o_proj.weight"].T
        if p + "self_attn.o_proj.bias" in t:
            o = o + t[p + "self_attn.o_proj.bias"]
        h = (normed if residual_norm else h) + o
        m = _rms(h, t[p + "post_attention_layernorm.weight"])
        return h + (F.silu(m @ t[p + "mlp.gate_proj.weight"].T)
                    * (m @ t[p + "mlp.up_proj.weight"].T)) @ t[p + "mlp.down_proj.weight"].T

    def head(out):
        if spec_norm_output:
            fed = _rms(out, t["norm.weight"])
            return fed @ t["lm_head.weight"].T, fed
        return (_rms(out, t["norm.weight"]) if head_norm else out) @ t["lm_head.weight"].T, out

    logits, fed = head(layer(h, ids))
    if fed_ids is None:
        return logits, fed
    # depth 2: the same causal layer over the n pairs plus one whose input is the state
    # fed back at position n - 1 (its own earlier positions are unchanged by causality)
    logits2, _ = head(layer(torch.cat([h, fed[:, -1:]], 1),
                            torch.cat([ids, fed_ids[:, None]], 1)))
    return torch.cat([logits, logits2[:, -1:]], 1), fed


def check(model, t, p, embed, th=H, **variant):
    """The loaded drafter's logits over its draft vocabulary and the state it feeds back,
    at depth 1 (7 pairs) and depth 2 (one more step from that state through the cache),
    against :func:`reference`: max |diff| <= 1e-5."""
    torch.manual_seed(1)
    feats = torch.randn(2, 7, 3 * th, dtype=torch.float64)
    ids, nxt = torch.randint(0, V, (2, 7)), torch.randint(0, V, (2,))
    want, want_fed = reference(t, p, feats, ids, embed, nxt, hd=model.meta.hidden_size,
                               **variant)
    draft = model.draft_ids
    with torch.no_grad():
        cache = DynamicCache()
        fed, logits = model(feats, ids, past_key_values=cache)
        _, logits2 = model(fed[:, -1:], nxt[:, None], past_key_values=cache)
    assert (fed - want_fed).abs().max() <= 1e-5
    got = torch.cat([logits, logits2], 1)[..., draft]
    assert (got - want).abs().max() <= 1e-5
    return fed


def same_meta(a, b) -> bool:
    """The same drafter meta, but for the target architecture an export records."""
    from dataclasses import replace

    return replace(a.meta, target_architecture="") == replace(b.meta, target_architecture="")


def greedy_is_plain(target_dir, folder):
    """Greedy decoding with the drafter gives plain decoding's tokens (depth 3 trees: the
    fed-back state is used)."""
    dec = Decoder.from_pretrained(target_dir)
    plain = dec.generate(prompt_ids=PROMPT, method="ar", max_new_tokens=10).token_ids
    spec = dec.generate(prompt_ids=PROMPT, method="eagle", eagle_model=str(folder),
                        max_new_tokens=10, depth=3, nodes=6, tree_top_k=2)
    assert spec.token_ids == plain


# --- item 1: speculators-trained EAGLE-3 -----------------------------------------------


def test_speculators_trainer_defaults_norm_before_residual_and_fc(tmp_path, target,
                                                                  target_dir):
    t = variant_tensors("layers.0.", input_norm=True)
    folder = tmp_path / "trained"
    speculators3(folder, t, norm_before_residual=True, norm_before_fc=True)
    model = load_eagle(folder, target.config, dtype=torch.float64, target=target)
    assert (model.meta.residual_norm, model.meta.fc_input_norm) == (True, True)
    check(model, t, "layers.0.", t["embed_tokens.weight"], residual_norm=True,
          input_norm=True)
    greedy_is_plain(target_dir, folder)
    # and back out: the flags and input_norm.weight are written, the reload is the same
    out = export_drafter(folder, "speculators", tmp_path / "out", target=target_dir)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["norm_before_residual"], cfg["norm_before_fc"], cfg["fc_norm"],
            cfg["norm_output"]) == (True, True, False, False)
    assert torch.equal(load_file(str(out / "model.safetensors"))["input_norm.weight"],
                       t["input_norm.weight"])
    assert same_meta(load_eagle(out), model)
    with pytest.raises(DrafterFormatError, match=r"--format eagle: .*normed residual "
                       r"\(norm_before_residual\), which neither the EAGLE code nor SpecForge"):
        export_drafter(folder, "eagle", tmp_path / "research", target=target_dir)


# --- item 2: EAGLE-3.1 ------------------------------------------------------------------


def test_speculators_eagle31_feeds_the_normed_state_back(tmp_path, target, target_dir):
    t = variant_tensors("layers.0.", fc_norm=True)
    folder = tmp_path / "e31"
    speculators3(folder, t, fc_norm=True, norm_output=True)
    model = load_eagle(folder, target.config, dtype=torch.float64, target=target)
    assert (model.meta.fc_state_norms, model.meta.feed_normed) == (True, True)
    fed = check(model, t, "layers.0.", t["embed_tokens.weight"], fc_norm=True,
                spec_norm_output=True)
    # the state fed back is norm(out): RMS 1 before the norm's weight
    w = t["norm.weight"].double()
    assert torch.allclose((fed / w).pow(2).mean(-1), torch.ones(2, 7, dtype=torch.float64),
                          atol=1e-4)
    greedy_is_plain(target_dir, folder)
    out = export_drafter(folder, "speculators", tmp_path / "out", target=target_dir)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["fc_norm"], cfg["norm_output"]) == (True, True)
    assert same_meta(load_eagle(out), model)
    with pytest.raises(DrafterFormatError, match=r"--format eagle: .*normed state fed back "
                       r"\(norm_output \(speculators'\)\)"):
        export_drafter(folder, "eagle", tmp_path / "research", target=target_dir)


@pytest.mark.parametrize("norm_output", [True, False])
def test_specforge_fc_norm_and_its_own_norm_output(tmp_path, target, target_dir,
                                                   norm_output):
    """SpecForge's EAGLE-3.1 config (configs/qwen3-30B-A3B-eagle3.1.json: fc_norm and
    norm_output true): fc_norm per state; norm_output there switches the final norm
    before the LM head, and what is fed back is the layer's output either way."""
    t = variant_tensors("midlayer.", fc_norm=True, embed=False)
    folder = tmp_path / f"specforge-{norm_output}"
    research3(folder, t, fc_norm=True, norm_output=norm_output)
    model = load_eagle(folder, target.config, dtype=torch.float64, target=target)
    assert (model.meta.fc_state_norms, model.meta.head_norm, model.meta.feed_normed) == (
        True, norm_output, False)
    check(model, t, "midlayer.", target.get_input_embeddings().weight.detach(),
          fc_norm=True, head_norm=norm_output)
    greedy_is_plain(target_dir, folder)
    out = export_drafter(folder, "eagle", tmp_path / "out", target=target_dir)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["fc_norm"] is True and cfg.get("norm_output", True) is norm_output
    assert same_meta(load_eagle(out), model)
    if not norm_output:  # speculators always normalises before the LM head
        with pytest.raises(DrafterFormatError, match=r"--format speculators: .*without the "
                           r"final norm \(SpecForge's norm_output: false\)"):
            export_drafter(folder, "speculators", tmp_path / "spec", target=target_dir)


# --- item 3: full vocabulary, num_hidden_layers, target_hidden_size, attention_bias ----


@pytest.mark.parametrize("fmt", ["eagle-code", "speculators"])
def test_full_vocabulary_without_d2t_t2d(tmp_path, target, target_dir, fmt):
    t = variant_tensors("midlayer." if fmt == "eagle-code" else "layers.0.", vd=V,
                        maps=False)
    folder = tmp_path / fmt
    if fmt == "eagle-code":  # ea_model.py deletes d2t / t2d; cnets ignores the layer count
        research3(folder, t, num_hidden_layers=2)
        prefix = "midlayer."
    else:  # Eagle3DraftModel registers them as None for a full vocabulary
        speculators3(folder, t)
        prefix = "layers.0."
    model = load_eagle(folder, target.config, dtype=torch.float64, target=target)
    assert model.meta.draft_vocab_size == 0 and bool(model.t2d.all())
    check(model, t, prefix, t["embed_tokens.weight"])
    greedy_is_plain(target_dir, folder)
    spec = export_drafter(folder, "speculators", tmp_path / "spec", target=target_dir)
    assert not {"d2t", "t2d"} & set(load_file(str(spec / "model.safetensors")))
    assert same_meta(load_eagle(spec), model)
    # a reduced vocabulary without the maps cannot say which target ids it holds
    bad = tmp_path / "reduced"
    research3(bad, variant_tensors("midlayer.", maps=False))
    with pytest.raises(DrafterFormatError, match=r"reduced/model.safetensors: has no d2t / "
                       r"t2d, but the draft vocabulary \(40\) is smaller"):
        load_eagle(bad, target.config, target=target)


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_target_hidden_size_other_than_the_drafters(tmp_path, target, target_dir, fmt):
    """fc maps 3 * target_hidden_size -> hidden_size (vLLM, SpecForge, the EAGLE code);
    the drafter's own embedding [V, hidden_size] comes from the file."""
    hd = 48
    prefix = "midlayer." if fmt == "specforge" else "layers.0."
    t = variant_tensors(prefix, hd=hd, th=H)
    layer = {**_llama_cfg(hidden=hd), "head_dim": hd // HEADS}
    folder = tmp_path / fmt
    if fmt == "specforge":
        research3(folder, t, **layer, target_hidden_size=H)
    else:
        speculators3(folder, t, layer=layer, target_hidden_size=H)
    model = load_eagle(folder, target.config, dtype=torch.float64, target=target)
    assert (model.meta.hidden_size, model.meta.target_hidden_size,
            model.meta.feature_width) == (hd, H, 3 * H)
    check(model, t, prefix, t["embed_tokens.weight"])
    greedy_is_plain(target_dir, folder)
    out = export_drafter(folder, "speculators", tmp_path / "out", target=target_dir)
    assert json.loads((out / "config.json").read_text())["target_hidden_size"] == H
    assert same_meta(load_eagle(out), model)
    # without its own embedding the target's (width 32) cannot stand in
    t.pop("embed_tokens.weight")
    bare = tmp_path / f"{fmt}-bare"
    if fmt == "specforge":
        research3(bare, t, **layer, target_hidden_size=H)
    else:
        speculators3(bare, t, layer=layer, target_hidden_size=H)
    with pytest.raises(DrafterFormatError, match=rf"{fmt}-bare/model.safetensors: has no "
                       rf"embed_tokens.weight, and the drafter's hidden_size=48 is not the "
                       rf"target's \(target_hidden_size=32\)"):
        load_eagle(bare, target.config, target=target)


@pytest.mark.parametrize("bias", ["qkvo", "qkv"])
def test_attention_biases(tmp_path, target, target_dir, bias):
    """attention_bias: q/k/v/o biases (speculators' and vLLM's LLaMA layer); qkv_bias:
    q/k/v alone (vLLM's LLaMA meaning), read from a research config."""
    if bias == "qkvo":
        t = variant_tensors("layers.0.", bias=bias)
        folder = tmp_path / "spec-bias"
        speculators3(folder, t, layer={**_llama_cfg(), "attention_bias": True})
        prefix = "layers.0."
    else:
        t = variant_tensors("midlayer.", bias=bias)
        folder = tmp_path / "research-qkv"
        research3(folder, t, qkv_bias=True)
        prefix = "midlayer."
    model = load_eagle(folder, target.config, dtype=torch.float64, target=target)
    assert (model.meta.qkv_bias, model.meta.o_bias) == (True, bias == "qkvo")
    check(model, t, prefix, t["embed_tokens.weight"])
    greedy_is_plain(target_dir, folder)
    if bias == "qkvo":
        out = export_drafter(folder, "speculators", tmp_path / "out", target=target_dir)
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["transformer_layer_config"]["attention_bias"] is True
        assert same_meta(load_eagle(out), model)
    else:
        with pytest.raises(DrafterFormatError, match=r"--format speculators: .*q/k/v "
                           r"projections have biases and o_proj none"):
            export_drafter(folder, "speculators", tmp_path / "out", target=target_dir)
    # biases in the file but not in the config are named as such
    plain = tmp_path / "undeclared"
    research3(plain, variant_tensors("midlayer.", bias="qkv"))
    with pytest.raises(DrafterFormatError, match=r"undeclared/model.safetensors: holds "
                       r"attention biases .* does not set attention_bias: true"):
        load_eagle(plain, target.config, target=target)


# --- refusals -------------------------------------------------------------------------


def test_what_no_speclab_drafter_computes_is_refused_naming_the_flag(tmp_path, target):
    cases = []
    multi = tmp_path / "multi"  # speculators stacks decoder layers after the first
    speculators3(multi, variant_tensors("layers.0."),
                 layer={**_llama_cfg(), "num_hidden_layers": 2})
    cases.append((multi, r"multi/config.json: transformer_layer_config.num_hidden_layers=2: "
                         r"a multi-layer EAGLE-3 drafter"))
    layers = tmp_path / "sglang-layers"  # more layer tensors than the one midlayer
    t = variant_tensors("midlayer.")
    t["layers.1.mlp.up_proj.weight"] = torch.ones(INTER, H)
    research3(layers, t, num_hidden_layers=2)
    cases.append((layers, r"sglang-layers/model.safetensors: holds decoder layers "
                          r"\['layers.1'\] besides midlayer \(config.json: "
                          r"num_hidden_layers=2\): a multi-layer"))
    fcn = tmp_path / "fc-norm-unflagged"  # fc_norm tensors without the flag
    research3(fcn, variant_tensors("midlayer.", fc_norm=True))
    cases.append((fcn, r"fc-norm-unflagged/model.safetensors: holds fc_norm.\* \(EAGLE-3.1's "
                       r"norm per fused target state\), but config.json does not set "
                       r"fc_norm: true"))
    inn = tmp_path / "input-norm-unflagged"
    speculators3(inn, variant_tensors("layers.0.", input_norm=True))
    cases.append((inn, r"input-norm-unflagged/model.safetensors: holds input_norm.weight "
                       r"\(norm_before_fc's"))
    half = tmp_path / "half-maps"
    t = variant_tensors("layers.0.")
    t.pop("t2d")
    speculators3(half, t)
    cases.append((half, r"half-maps/model.safetensors: holds d2t without t2d"))
    for folder, message in cases:
        with pytest.raises(DrafterFormatError, match=rf"eagle_model: .*{message}"):
            load_eagle(folder, target.config, target=target)


def test_export_refusals_and_what_speculators_exports_carry(tmp_path, target, target_dir):
    from dataclasses import replace

    from speclab.families.eagle.model import EagleMeta, save_eagle
    from speclab.families.eagle.model3 import Eagle3Model

    # EAGLE-1/2 to speculators: no runtime reads speculators_model_type: eagle
    eagle1 = EagleMeta.for_target(target.config, 1, False, False)
    with pytest.raises(DrafterFormatError, match=r"output.export: 'speculators' cannot hold "
                       r".*speculators removed its EAGLE-1/2 algorithm .*--format eagle"):
        check_exports(["speculators"], eagle1)
    check_exports(["eagle"], eagle1)
    # feature layer 0 (the embedding output) has no SpecForge / SGLang id
    base = Eagle3Model.from_target(target).meta
    zero = replace(base, feature_layers=(0, 4, 5))
    check_exports(["speculators"], zero)
    with pytest.raises(DrafterFormatError, match=r"'eagle' cannot hold .*feature_layers "
                       r"include 0, the target's embedding output: .*SpecForge refuses"):
        check_exports(["eagle"], zero)
    # the verifier's architecture: from the drafter, else the target's local config, else
    # refused naming --target; max_position_embeddings: max(drafter, target)
    src = tmp_path / "research"
    research3(src, variant_tensors("midlayer."), max_position_embeddings=256)
    from speclab.models.formats.speculators import write_speculators_eagle3

    with pytest.raises(DrafterFormatError, match=r"verifier.architectures .* unknown: .* "
                       r"give --target as the target's local folder"):
        write_speculators_eagle3(load_eagle(src, target=target), tmp_path / "hub",
                                 "org/tiny-target")
    out = export_drafter(src, "speculators", tmp_path / "spec", target=target_dir)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    assert cfg["transformer_layer_config"]["max_position_embeddings"] == 512  # the target's
    mine = save_eagle(Eagle3Model(replace(base, max_positions=4096)), tmp_path / "long")
    out = export_drafter(mine, "speculators", tmp_path / "spec-long", target=target_dir)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["transformer_layer_config"]["max_position_embeddings"] == 4096

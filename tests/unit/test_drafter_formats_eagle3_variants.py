"""EAGLE-3 variants in (issue 57): speculators-trained drafters (``norm_before_residual``,
``norm_before_fc``), EAGLE-3.1 (speculators' ``fc_norm`` + ``norm_output``: the normed
state fed back; SpecForge's ``fc_norm`` + ``norm_output``: THERE the final norm before
the LM head), full-vocabulary checkpoints without ``d2t`` / ``t2d``, a research config
whose ``num_hidden_layers`` the EAGLE code ignores, ``target_hidden_size`` other than the
drafter's width, and ``attention_bias``. Each tiny checkpoint is written in its public
layout and the loaded drafter's logits (and the state fed back at depth 2) are compared
with a float64 forward written here from the public code's math (speculators'
``Eagle3DraftModel`` / ``Eagle3FirstLayerMixin``, SpecForge's ``LlamaForCausalLMEagle3``,
vLLM's ``llama_eagle3.py``, EAGLE's ``cnets.py``). Decoding: greedy decoding with each
loaded drafter equals plain decoding (a smoke test of the decode path only: greedy
speculative decoding gives plain decoding's tokens whatever the drafter), and, the real
check, a drafter of each variant built in its public layout to draft the target's own
next token (on a bigram target, whose layers add nothing: :func:`oracle_tensors`) has a
draft accepted in every round, and so does its export round trip, with the same
per-round accepted lengths (a control wired the other way round is rejected). Variants
no speclab drafter computes are refused naming the flag; exports carry the flags back and
refuse what their format (and the code that reads it) cannot hold; attention biases are
the ones the weight file holds."""

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

pytestmark = pytest.mark.usefixtures("one_torch_thread")


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


def decode_smoke(target_dir, folder):
    """A SMOKE TEST of the decode path, not a check of the drafter: EAGLE decoding with
    the drafter in ``folder`` runs (depth 3 trees: the fed-back state goes through the
    cache) and, greedy, gives plain decoding's tokens, which greedy speculative decoding
    does whatever the drafter proposes. What the drafter computes is checked by
    :func:`check` and :func:`oracle_rounds`."""
    dec = Decoder.from_pretrained(target_dir)
    plain = dec.generate(prompt_ids=PROMPT, method="ar", max_new_tokens=10).token_ids
    spec = dec.generate(prompt_ids=PROMPT, method="eagle", eagle_model=str(folder),
                        max_new_tokens=10, depth=3, nodes=6, tree_top_k=2)
    assert spec.token_ids == plain


# --- drafters that draft the target's own next token, in each variant's layout ---------


@pytest.fixture(scope="module")
def oracle_target_dir(tmp_path_factory):
    """A bigram target: the tiny LLaMA (seed 11) with every decoder layer adding nothing
    (o_proj and down_proj zero), so its next token is ``g(x) = argmax lm_head(norm(
    Embed(x)))`` of the current token alone; its embedding rows ``[u_x, C]`` (``u_x``:
    31 dims of one norm, dim 31 a constant ``C`` the LM head ignores). A drafter can
    then compute the target's token after the one it is given (:func:`oracle_tensors`)."""
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("oracle")
    model = LlamaForCausalLM.from_pretrained(
        build_tiny_llama(root / "src", seed=11, vocab_size=V, hidden_size=H,
                         num_layers=LAYERS))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        emb[:, : H - 1] = emb[:, : H - 1] / emb[:, : H - 1].norm(dim=-1, keepdim=True) * 4.0
        emb[:, H - 1] = 3.0
        model.lm_head.weight[:, H - 1] = 0.0
    model.save_pretrained(root / "target")
    return str(root / "target")


@pytest.fixture(scope="module")
def oracle_decoder(oracle_target_dir):
    """The bigram target's Decoder and its plain greedy tokens (not one repeated token)."""
    dec = Decoder.from_pretrained(oracle_target_dir)
    plain = dec.generate(prompt_ids=PROMPT, method="ar", max_new_tokens=12).token_ids
    assert len(set(plain)) >= 4, plain
    return dec, plain


def oracle_tensors(prefix: str, target_dir: str, *, hd: int = H, bias: str = "",
                   fc_norm: bool = False, input_norm: bool = False, head_norm: bool = True,
                   embed: bool = True, embedding_second: bool = False) -> dict:
    """The public tensors (:func:`variant_tensors`: full vocabulary, norms perturbed) of
    a drafter that, given target features and the next token ``x`` (EAGLE's pair), drafts
    the bigram target's ``g(x)``, as the public math computes it (:func:`reference`):

    - ``fc`` puts the fused third state's constant dim into the drafter's last dim, so
      ``h`` (and ``hidden_norm(h)``) is the same at every position;
    - every head's q and k read that constant into their first RoPE pair (frequency 1),
      scaled so that a position attends to itself alone (``cos(d) <= cos(25) < 0.992``
      for the offsets of a short sequence, scores ~3500);
    - v copies ``input_layernorm(Embed(x))``'s first 31 dims (its elementwise weight
      undone), o_proj is the identity there, down_proj and every attention bias zero:
      ``out`` is ``Embed(x)``'s 31 dims times a constant, plus the constant dim;
    - the LM head is the target's times the target's final norm weight (the drafter's
      ``norm`` weight undone when the head reads ``norm(out)``), zero on the rest.

    The draft logits are then the target's next ones times a positive number.
    ``embedding_second``: v reads the hidden half instead (a drafter whose layer took
    the halves the other way round; a control)."""
    from transformers import LlamaForCausalLM

    tgt = LlamaForCausalLM.from_pretrained(target_dir)
    t = variant_tensors(prefix, hd=hd, th=H, vd=V, bias=bias, fc_norm=fc_norm,
                        input_norm=input_norm, embed=embed, maps=False, seed=7)
    n = H - 1  # the embedding dims that carry the token
    d = hd // HEADS
    t["fc.weight"] = torch.zeros(hd, 3 * H)
    t["fc.weight"][hd - 1, 2 * H + n] = 1.0
    for name in ("q", "k", "v", "o"):
        t[f"{prefix}self_attn.{name}_proj.weight"].zero_()
        if f"{prefix}self_attn.{name}_proj.bias" in t:
            t[f"{prefix}self_attn.{name}_proj.bias"].zero_()
    t[f"{prefix}mlp.down_proj.weight"].zero_()
    const = t[prefix + "hidden_norm.weight"][hd - 1] * hd ** 0.5  # hidden_norm(h)'s dim
    for name in ("q", "k"):
        for head in range(HEADS):
            t[f"{prefix}self_attn.{name}_proj.weight"][head * d, hd + hd - 1] = 100 / const
    w_in = t[prefix + "input_layernorm.weight"]
    cols = torch.arange(n) + (hd if embedding_second else 0)
    t[f"{prefix}self_attn.v_proj.weight"][torch.arange(n), cols] = 1 / w_in[:n]
    t[f"{prefix}self_attn.o_proj.weight"][torch.arange(n), torch.arange(n)] = 1.0
    with torch.no_grad():
        head = tgt.lm_head.weight[:, :n] * tgt.model.norm.weight[None, :n]
    t["lm_head.weight"] = torch.zeros(V, hd)
    t["lm_head.weight"][:, :n] = head / (t["norm.weight"][None, :n] if head_norm else 1.0)
    if embed:
        own = torch.zeros(V, hd)
        own[:, :H] = tgt.model.embed_tokens.weight.detach()
        t["embed_tokens.weight"] = own
    return t


def oracle_rounds(dec, plain: list[int], folder) -> list[int]:
    """EAGLE decoding on the bigram target with the drafter in ``folder`` (greedy,
    depth 3 trees): the per-round accepted lengths, after checking the tokens are plain
    decoding's."""
    spec = dec.generate(prompt_ids=PROMPT, method="eagle", eagle_model=str(folder),
                        max_new_tokens=12, depth=3, nodes=6, tree_top_k=2)
    assert spec.token_ids == plain
    return spec.stats.accepted_lengths


#: name -> (layout, oracle_tensors arguments, config flags, export format or None)
ORACLE_CASES = {
    "default": ("speculators", {}, {}, "eagle"),
    "speculators-trained": ("speculators", {"input_norm": True},
                            {"norm_before_fc": True, "norm_before_residual": True},
                            "speculators"),
    "speculators-eagle31": ("speculators", {"fc_norm": True},
                            {"fc_norm": True, "norm_output": True}, "speculators"),
    "specforge-eagle31": ("research", {"fc_norm": True, "embed": False},
                          {"fc_norm": True, "norm_output": True}, "speculators"),
    "specforge-no-head-norm": ("research", {"fc_norm": True, "head_norm": False,
                                            "embed": False},
                               {"fc_norm": True, "norm_output": False}, None),
    "target-hidden-size": ("research", {"hd": 48}, {"target_hidden_size": H}, "eagle"),
    "attention-bias": ("speculators", {"bias": "qkvo"}, {"attention_bias": True},
                       "speculators"),
    "full-vocab-2-layers": ("research", {}, {"num_hidden_layers": 2}, "eagle"),
}


@pytest.mark.parametrize("name", list(ORACLE_CASES))
def test_a_variant_drafter_drafting_the_targets_token_is_accepted_every_round(
        tmp_path, oracle_decoder, oracle_target_dir, name):
    """The real decode check: a drafter of each variant, written in its public layout,
    that drafts the bigram target's next token (:func:`oracle_tensors`) has its first
    draft accepted in every round (each commits >= 2 tokens; a drafter proposing
    anything else would not), and so has the same drafter reloaded from its export, with
    the same per-round accepted lengths. The control: the same weights with the layer's
    halves read the other way round (hidden first) are rejected somewhere."""
    layout, args, flags, fmt = ORACLE_CASES[name]
    dec, plain = oracle_decoder
    prefix = "midlayer." if layout == "research" else "layers.0."
    hd = args.get("hd", H)
    layer = {**_llama_cfg(hidden=hd), "head_dim": hd // HEADS}
    flags = dict(flags)
    for key in ("attention_bias", "num_hidden_layers"):
        if key in flags:
            layer[key] = flags.pop(key)
    folder = tmp_path / name
    t = oracle_tensors(prefix, oracle_target_dir, **args)
    if layout == "research":
        research3(folder, t, **{**layer, **flags})
    else:
        speculators3(folder, t, layer=layer, **flags)
    lengths = oracle_rounds(dec, plain, folder)
    assert len(lengths) >= 3 and min(lengths[:-1]) >= 2, lengths  # the last may be cut
    if fmt is not None:
        out = export_drafter(folder, fmt, tmp_path / "out", target=oracle_target_dir)
        assert oracle_rounds(dec, plain, out) == lengths
    if name == "default":  # the check has teeth
        wrong = tmp_path / "embedding-second"
        speculators3(wrong, oracle_tensors(prefix, oracle_target_dir,
                                           embedding_second=True), layer=layer)
        assert min(oracle_rounds(dec, plain, wrong)[:-1]) == 1


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
    decode_smoke(target_dir, folder)
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
    decode_smoke(target_dir, folder)
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
    decode_smoke(target_dir, folder)
    # the EAGLE code's cnets.py has no fc_norm (ea_model.py's strict=False load would drop
    # it silently), nor has SGLang's llama_eagle3.py: --format eagle refuses, naming
    # --format speculators
    with pytest.raises(DrafterFormatError, match=r"--format eagle: .*each fused target "
                       r"state \(fc_state_norms; fc_norm, EAGLE-3.1\): the EAGLE code's "
                       r"cnets.py has no fc_norm .*strict=False.*use --format speculators"):
        export_drafter(folder, "eagle", tmp_path / "research", target=target_dir)
    if norm_output:  # speculators' fc_norm, its norm_output false: the same computation
        out = export_drafter(folder, "speculators", tmp_path / "spec", target=target_dir)
        cfg = json.loads((out / "config.json").read_text())
        assert (cfg["fc_norm"], cfg["norm_output"]) == (True, False)
        assert same_meta(load_eagle(out), model)
    else:  # speculators always normalises before the LM head
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
    decode_smoke(target_dir, folder)
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
    decode_smoke(target_dir, folder)
    # speculators 0.9.0 builds fc as num_aux * hidden_size: refused, naming the field
    with pytest.raises(DrafterFormatError, match=r"--format speculators: .*"
                       r"target_hidden_size=32 differs from the drafter's hidden_size=48: "
                       r"speculators 0.9.0 sizes fc .*by hidden_size"):
        export_drafter(folder, "speculators", tmp_path / "spec", target=target_dir)
    # the EAGLE code's cnets.py reads it (fc: 3 * target_hidden_size)
    out = export_drafter(folder, "eagle", tmp_path / "out", target=target_dir)
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


@pytest.mark.parametrize("bias", ["qkvo", "qkv", "o"])
def test_attention_biases_are_the_ones_the_file_holds(tmp_path, target, target_dir, bias):
    """The bias tensors decide (q/k/v: all three; o_proj's), whatever attention_bias /
    qkv_bias say: no EAGLE-3 runtime reads qkv_bias as q/k/v-only (vLLM's qkv_proj takes
    attention_bias, speculators' HF LLaMA layer ignores qkv_bias)."""
    t = variant_tensors("layers.0.", bias="qkvo" if bias == "o" else bias)
    if bias == "o":
        for name in "qkv":
            t.pop(f"layers.0.self_attn.{name}_proj.bias")
    folder = tmp_path / f"spec-{bias}"
    speculators3(folder, t, layer={**_llama_cfg(), "attention_bias": bias == "qkvo"})
    model = load_eagle(folder, target.config, dtype=torch.float64, target=target)
    assert (model.meta.qkv_bias, model.meta.o_bias) == ("q" in bias, "o" in bias)
    check(model, t, "layers.0.", t["embed_tokens.weight"])
    decode_smoke(target_dir, folder)
    if bias == "qkvo":
        out = export_drafter(folder, "speculators", tmp_path / "out", target=target_dir)
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["transformer_layer_config"]["attention_bias"] is True
        assert same_meta(load_eagle(out), model)
    else:
        which = "q/k/v projections have biases and o_proj none" if bias == "qkv" \
            else "o_proj has a bias and the q/k/v projections none"
        with pytest.raises(DrafterFormatError, match=rf"--format speculators: .*{which}"):
            export_drafter(folder, "speculators", tmp_path / "out", target=target_dir)
    # the EAGLE code's cnets.py builds the EAGLE-3 attention with bias=False
    with pytest.raises(DrafterFormatError, match=r"--format eagle: .*attention biases .*"
                       r"cnets.py builds the EAGLE-3 layer's q/k/v/o_proj with bias=False"):
        export_drafter(folder, "eagle", tmp_path / "research", target=target_dir)


def test_bias_flags_without_bias_tensors_load_and_partial_sets_are_refused(tmp_path, target):
    """A config flag alone adds no bias (speculators loads such a qkv_bias: true config;
    SpecForge and the EAGLE code build an attention_bias: true drafter without biases);
    biases the config does not mention load; q/k/v biases but one are refused naming the
    missing tensor."""
    t = variant_tensors("layers.0.")
    flagged = tmp_path / "spec-flag"
    speculators3(flagged, t, layer={**_llama_cfg(), "qkv_bias": True})
    model = load_eagle(flagged, target.config, dtype=torch.float64, target=target)
    assert (model.meta.qkv_bias, model.meta.o_bias) == (False, False)
    check(model, t, "layers.0.", t["embed_tokens.weight"])
    t = variant_tensors("midlayer.")
    research = tmp_path / "research-flag"
    research3(research, t, attention_bias=True, qkv_bias=True)
    model = load_eagle(research, target.config, dtype=torch.float64, target=target)
    assert (model.meta.qkv_bias, model.meta.o_bias) == (False, False)
    check(model, t, "midlayer.", t["embed_tokens.weight"])
    t = variant_tensors("midlayer.", bias="qkvo")
    unflagged = tmp_path / "research-unflagged"
    research3(unflagged, t)
    model = load_eagle(unflagged, target.config, dtype=torch.float64, target=target)
    assert (model.meta.qkv_bias, model.meta.o_bias) == (True, True)
    check(model, t, "midlayer.", t["embed_tokens.weight"])
    t.pop("midlayer.self_attn.k_proj.bias")
    partial = tmp_path / "partial"
    research3(partial, t, attention_bias=True)
    with pytest.raises(DrafterFormatError, match=r"partial/model.safetensors: holds "
                       r"midlayer.self_attn.q_proj.bias but no midlayer.self_attn.k_proj.bias: "
                       r"the q/k/v biases come together"):
        load_eagle(partial, target.config, target=target)


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


def test_each_export_format_refuses_what_the_code_reading_it_does_not_compute(target):
    """--format eagle (the EAGLE code's cnets.py, SGLang): no norm_before_residual /
    norm_before_fc / speculators' norm_output / attention biases / fc_norm / head without
    the final norm (cnets.py always computes lm_head(norm(h)), bias=False, no fc_norm, and
    ea_model.py's strict=False load drops unknown tensors silently); target_hidden_size
    it reads. --format speculators (0.9.0): no target_hidden_size != hidden_size (fc is
    num_aux * hidden_size wide), no head without the final norm, biases all four or none.
    Each refusal names the meta flag."""
    from dataclasses import replace

    from speclab.families.eagle.model3 import Eagle3Model

    base = Eagle3Model.from_target(target).meta
    wide = replace(base, hidden_size=48, heads=4, target_hidden_size=H)
    eagle = [({"residual_norm": True}, r"normed residual \(norm_before_residual\)"),
             ({"fc_input_norm": True}, r"fused target states \(norm_before_fc\)"),
             ({"feed_normed": True, "fc_state_norms": True},
              r"normed state fed back \(norm_output \(speculators'\)\)"),
             ({"qkv_bias": True, "o_bias": True}, r"attention biases \(qkv_bias=True, "
                                                  r"o_bias=True; attention_bias\): .*"
                                                  r"bias=False"),
             ({"qkv_bias": True}, r"attention biases \(qkv_bias=True, o_bias=False"),
             ({"fc_state_norms": True}, r"\(fc_state_norms; fc_norm, EAGLE-3.1\): the "
                                        r"EAGLE code's cnets.py has no fc_norm .*SGLang.*"
                                        r"use --format speculators, which carries fc_norm"),
             ({"head_norm": False}, r"without the final norm \(head_norm false; "
                                    r"SpecForge's norm_output: false\): the EAGLE code's "
                                    r"cnets.py and SGLang always compute lm_head\(norm\(h\)\)")]
    for fields, why in eagle:
        with pytest.raises(DrafterFormatError, match=rf"'eagle' cannot hold .*{why}"):
            check_exports(["eagle"], replace(base, **fields))
    check_exports(["eagle"], wide)
    speculators = [(wide, r"target_hidden_size=32 differs from the drafter's hidden_size="
                          r"48: speculators 0.9.0 sizes fc \(and fc_norm\) by hidden_size"),
                   (replace(base, head_norm=False), r"without the final norm"),
                   (replace(base, qkv_bias=True), r"q/k/v projections have biases and "
                                                  r"o_proj none \(qkv_bias=True, o_bias=False\)"),
                   (replace(base, o_bias=True), r"o_proj has a bias and the q/k/v "
                                                r"projections none")]
    for meta, why in speculators:
        with pytest.raises(DrafterFormatError, match=rf"'speculators' cannot hold .*{why}"):
            check_exports(["speculators"], meta)
    for fields, _ in eagle[:4]:  # speculators carries these
        check_exports(["speculators"], replace(base, **fields))


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

"""The EAGLE research code's format (SafeAILab/EAGLE ``cnets.py`` / ``ea_model.py``, for
EAGLE-1 and EAGLE-2; HASS checkpoints use the same one).

A folder holds ``config.json`` — the LLaMA config of the drafter's layers
(``hidden_size``, ``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads``,
``num_hidden_layers``, ``vocab_size``, ``rms_norm_eps``, ``rope_theta``, ``rope_scaling``,
``max_position_embeddings``, ``hidden_act``; optional ``bias``: fc's bias, default True) —
and ``pytorch_model.bin`` or ``model.safetensors`` (or a sharded index) with

- ``fc.weight [H, 2H]`` over ``concat(Embed(x_{t+1}), f_t)`` and ``fc.bias [H]`` (if any),
- ``layers.<i>.self_attn.{q,k,v,o}_proj.weight``, ``layers.<i>.mlp.{gate,up,down}_proj.weight``,
  ``layers.<i>.post_attention_layernorm.weight``, and ``layers.<i>.input_layernorm.weight``
  for ``i >= 1`` only (layer 0 has no input norm),
- ``embed_tokens.weight [V, H]`` (a copy of the target's; absent: the target's is used).

There is no final norm and no LM head: the target's LM head reads the last layer's
output. Loading builds an :class:`~speclab.families.eagle.model.EagleModel` with
``input_norm = final_norm = False``; writing needs a drafter in that layout (a drafter
with speclab's norms has tensors EAGLE's strict ``load_state_dict`` would refuse).

EAGLE-3 (the EAGLE authors' ``cnets.py`` for EAGLE-3, and what SpecForge's
``LlamaForCausalLMEagle3`` saves): ``config.json`` is a LLaMA config of the drafter's one
layer plus ``draft_vocab_size`` (``architectures`` e.g. ``["LlamaForCausalLMEagle3"]``;
optional ``target_hidden_size``, ``eagle_config.eagle_aux_hidden_state_layer_ids``,
``eagle_aux_hidden_state_layer_ids``); the weights (``pytorch_model.bin`` /
``model.safetensors``) hold ``fc.weight [H, 3H]``, ``midlayer.{self_attn,mlp}.*``,
``midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight``,
``norm.weight``, ``lm_head.weight [V_d, H]``, ``d2t [V_d]``, ``t2d [V]`` and, from the
EAGLE code, ``embed_tokens.weight`` (SpecForge leaves it out: the target's is used). The
mapping onto :class:`~speclab.families.eagle.model3.Eagle3Model` is
:mod:`.eagle3_layers`'. Writing (``--format eagle`` for an EAGLE-3 drafter) gives
everything EAGLE's strict ``load_state_dict`` wants (embedding included) in
``pytorch_model.bin``, and names the drafter's target layers both ways (vLLM's top-level
``eagle_aux_hidden_state_layer_ids``, SpecForge / SGLang's ``eagle_config``); the EAGLE
code itself always reads EAGLE-3's default layers (2, L // 2, L - 3), so a drafter
trained on other layers runs there only through vLLM, SGLang or speclab.

EAGLE-3 variants read from this layout (:mod:`.eagle3_layers`): ``target_hidden_size``
(fc reads ``3 * target_hidden_size``; the drafter's own ``embed_tokens`` then must be in
the file), SpecForge's ``fc_norm`` (``fc_norm.{0,1,2}.weight``, EAGLE-3.1) and SpecForge's
``norm_output`` (false: the LM head reads the layer's output without the final norm; the
state fed back is the layer's output either way), attention biases (the ones the file
holds), no ``d2t`` / ``t2d`` for a full vocabulary, and a ``num_hidden_layers`` other than
1 when the file holds the one ``midlayer`` (the EAGLE code ignores the field).
speculators' ``norm_before_residual`` / ``norm_before_fc`` are refused here (neither the
EAGLE code nor SpecForge computes them). Writing: ``target_hidden_size`` is the one
variant written (``cnets.py`` reads it); ``fc_norm``, ``norm_output: false`` and attention
biases are refused, since the EAGLE code's ``cnets.py`` (and SGLang's ``llama_eagle3.py``)
computes none of them and ``ea_model.py`` would drop their tensors silently
(``strict=False``): :func:`.eagle3_layers.public_problem`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from speclab.families.eagle.model import EagleMeta, EagleModel
from speclab.models.formats import eagle3_layers as e3
from speclab.models.formats.detect import eagle3_config
from speclab.models.formats.eagle_layers import (
    assemble,
    check_target_shape,
    llama_config_dict,
    llama_fields,
    public_tensors,
)
from speclab.models.formats.files import (
    DrafterFormatError,
    TargetParts,
    fail,
    read_config,
    read_tensors,
    weight_file,
)


def _read_config_and_weights(folder: Path, field: str) -> tuple[dict, Path, Path]:
    """A research-format folder's ``config.json`` (as a dict), its path, and its weight
    file (a DrafterFormatError naming the folder when there is none)."""
    cfg = read_config(folder, field)
    weights = weight_file(folder)
    if weights is None:
        raise fail(field, folder, "has no model.safetensors / pytorch_model.bin")
    return cfg, folder / "config.json", weights


def read_eagle_research(folder: Path, target: TargetParts | None, field: str,
                        advice: str = "", target_config=None) -> EagleModel:
    """The drafter in ``folder`` (EAGLE-1/2 / HASS research format) as an EagleModel
    (``f_hat [B, T, H]``, logits ``[B, T, V]`` from ``features [B, T, H]``, ``ids [B, T]``),
    its shapes checked against ``target.config`` or ``target_config`` (the target's HF
    config) when given, its LM head (and missing embedding) taken from ``target``.
    Errors name the file, the field and what was found (``advice``: appended to a
    missing-LM-head error)."""
    folder = Path(folder)
    cfg, where, weights = _read_config_and_weights(folder, field)
    tensors = read_tensors(weights, field)
    if "embed_layernorm.weight" in tensors or "hidden_layernorm.weight" in tensors:
        raise fail(field, weights, "holds embed_layernorm / hidden_layernorm (the HASS 'TTT' "
                   "variant with a norm on the token embedding): speclab's drafter has no "
                   "such norm")
    fields = llama_fields(cfg, where, field)
    layers = cfg.get("num_hidden_layers", 1)
    have = sorted({int(k.split(".")[1]) for k in tensors
                   if k.startswith("layers.") and k.split(".")[1].isdigit()})
    if not isinstance(layers, int) or have != list(range(layers)):
        raise fail(field, where, f"num_hidden_layers={layers!r}, but {weights.name} holds "
                   f"layers {have}")
    bias = "fc.bias" in tensors
    if "bias" in cfg and bool(cfg["bias"]) != bias:
        raise fail(field, where, f"bias={cfg['bias']!r}, but {weights.name} "
                   f"{'holds' if bias else 'has no'} fc.bias")
    meta = EagleMeta(target_architecture="", layers=layers, input_norm=False,
                     final_norm=False, fc_bias=bias, **fields)
    config = target.config if target is not None else target_config
    if config is not None:  # before the LM head is looked for: the shapes come first
        check_target_shape(meta, config, where, field)
    return assemble(meta, tensors, weights, field, target, advice)


def eagle_research_problem(meta: EagleMeta) -> str | None:
    """Why a drafter with ``meta`` cannot be written in this format exactly (None: it
    can)."""
    if meta.input_norm or meta.final_norm:
        which = " and ".join(n for n, on in (("an input norm in layer 0", meta.input_norm),
                                            ("a final norm", meta.final_norm)) if on)
        return (f"the drafter has {which} (speclab's layout: config.json input_norm="
                f"{meta.input_norm}, final_norm={meta.final_norm}); EAGLE-1/2's layer 0 has "
                f"no input norm and there is no final norm, so these weights have no place "
                f"in the format (EAGLE's code loads its state dict strictly); train the "
                f"drafter with eagle.norms: false to export it here")
    if meta.embed_scale != 1.0:
        return (f"the drafter scales the token embedding by {meta.embed_scale:g} (its "
                f"target family's multiplier, embed_scale); EAGLE's code embeds unscaled")
    if meta.head_dim and meta.head_dim != meta.hidden_size // meta.heads:
        return (f"head_dim={meta.head_dim}, but EAGLE's code derives head_dim = "
                f"hidden_size / num_attention_heads = {meta.hidden_size // meta.heads}")
    return None


def write_eagle_research(model: EagleModel, out: Path, field: str = "--format eagle") -> Path:
    """Write ``model`` as an EAGLE research-code checkpoint: ``config.json`` (LLaMA config
    plus ``bias``) and ``pytorch_model.bin`` (what every version of EAGLE's
    ``EaModel.from_pretrained`` reads). A drafter the format cannot hold exactly is a
    DrafterFormatError naming why (:func:`eagle_research_problem`)."""
    problem = eagle_research_problem(model.meta)
    if problem:
        raise DrafterFormatError(f"{field}: cannot write this drafter in the EAGLE research "
                                 f"format: {problem}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = llama_config_dict(model.meta, model.meta.layers)
    cfg.update({"bias": model.meta.fc_bias, "pretraining_tp": 1, "torch_dtype": "float32"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    state = {k: t.float() for k, t in public_tensors(model).items()}
    torch.save(state, out / "pytorch_model.bin")
    return out


def read_eagle3_research(folder: Path, target: TargetParts | None, field: str,
                         advice: str = "", target_config=None):
    """The EAGLE-3 drafter in ``folder`` (the EAGLE authors' / SpecForge's format, module
    docstring) as an :class:`~speclab.families.eagle.model3.Eagle3Model`, its shapes checked
    against ``target.config`` or ``target_config`` when given, its target layers the ones
    the config names or EAGLE-3's default for the target, its embedding (when the file has
    none) the target's. Errors name the file, the field and what was found."""
    folder = Path(folder)
    cfg, where, weights = _read_config_and_weights(folder, field)
    fields = llama_fields(cfg, where, field, bias_from_tensors=True)
    layers = cfg.get("num_hidden_layers", 1)
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        raise fail(field, where, f"num_hidden_layers={layers!r}: a positive integer is "
                   f"needed")
    variant = e3.variant_fields(cfg, fields["hidden_size"], where, field, research=True)
    named = e3.named_layers(cfg, where, field)
    tensors = read_tensors(weights, field)
    if not any(k.startswith(e3.RESEARCH_PREFIX) for k in tensors):
        have = sorted({k.split(".")[0] for k in tensors})
        why = (f"config.json marks an EAGLE-3 drafter (draft_vocab_size="
               f"{cfg.get('draft_vocab_size')!r}, architectures={cfg.get('architectures')!r})"
               if eagle3_config(cfg)
               else "it holds EAGLE-3's d2t / t2d")
        raise fail(field, weights, f"has no {e3.RESEARCH_PREFIX}* (the EAGLE-3 layer), but "
                   f"{why}; found {have[:6]}")
    more = sorted({".".join(k.split(".")[:2]) for k in tensors
                   if k.count(".") > 1 and k.split(".")[1].isdigit()
                   and not k.startswith("fc_norm.")})
    if more:  # the EAGLE code builds one midlayer whatever num_hidden_layers says
        raise fail(field, weights, f"holds decoder layers {more[:3]} besides midlayer "
                   f"(config.json: num_hidden_layers={layers}): a multi-layer EAGLE-3 "
                   f"drafter, which speclab's (one layer, like the EAGLE code's) does not "
                   f"compute")
    return e3.build(cfg, fields, named, tensors, e3.RESEARCH_PREFIX, "", where, weights,
                    field, target, target_config, advice, variant=variant)


def eagle3_research_problem(meta: EagleMeta, num_layers: int | None = None) -> str | None:
    """Why an EAGLE-3 drafter with ``meta`` cannot be written in the EAGLE-3 research
    format exactly (None: it can); ``num_layers``: the target's depth when known."""
    return e3.public_problem(meta, "the EAGLE-3 research format", num_layers, research=True)


def write_eagle3_research(model, out: Path, field: str = "--format eagle",
                          num_layers: int | None = None) -> Path:
    """Write the EAGLE-3 drafter ``model`` as the EAGLE authors' EAGLE-3 checkpoint:
    ``config.json`` (LLaMA config, ``architectures: [LlamaForCausalLMEagle3]``,
    ``draft_vocab_size``, the target layers both ways) and ``pytorch_model.bin``
    (``embed_tokens``, ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``:
    the EAGLE code's strict state dict). A drafter the format cannot hold exactly is a
    DrafterFormatError naming why."""
    problem = eagle3_research_problem(model.meta, num_layers)
    if problem:
        raise DrafterFormatError(f"{field}: cannot write this drafter in the EAGLE-3 research "
                                 f"format: {problem}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = llama_config_dict(model.meta, 1)
    cfg.update({"architectures": ["LlamaForCausalLMEagle3"], **e3.meta_fields(model.meta),
                "pretraining_tp": 1, "torch_dtype": "float32"})
    if model.meta.target_hidden_size:  # the EAGLE code and SpecForge: fc reads 3 * this
        cfg["target_hidden_size"] = model.meta.target_hidden_size
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    torch.save(e3.public_tensors(model, e3.RESEARCH_PREFIX), out / "pytorch_model.bin")
    return out

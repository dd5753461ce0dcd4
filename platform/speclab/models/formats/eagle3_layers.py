"""The tensors and config fields public EAGLE-3 checkpoints share, mapped onto speclab's
:class:`~speclab.families.eagle.model3.Eagle3Model` and back.

Every public EAGLE-3 drafter (the EAGLE authors' ``cnets.py``, SpecForge's
``llama3_eagle.py``, speculators' ``eagle3``, vLLM's ``llama_eagle3.py``) computes what
speclab's does, with the same tensors::

    h   = fc(concat(state_a, state_b, state_c))         # fc.weight [H, 3H], no bias
    x   = concat(input_layernorm(Embed(x_{t+1})), hidden_norm(h))   # EMBEDDING FIRST, [2H]
    h'  = h + o_proj(attention(q, k, v of x))           # q/k/v_proj [*, 2H]
    out = h' + mlp(post_attention_layernorm(h'))        # fed back for the next draft step
    logits over the draft vocabulary = lm_head(norm(out)),  draft id i = target id i + d2t[i]

so the mapping is a renaming (no column swap, unlike EAGLE-1/2's ``fc``):

========================================  ===========================================
public name (``P`` = ``midlayer.`` in the  speclab :class:`Eagle3Model`
research code / SpecForge, ``layers.0.``
in speculators)
========================================  ===========================================
``embed_tokens.weight [V, H]`` (optional)  ``embed.weight`` (absent: the target's)
``fc.weight [H, k*H]``, ``fc.bias``        ``fc.weight``, ``fc.bias`` (old speculators)
``P{self_attn,mlp}.*``, ``P*norm.weight``  ``layer.*``
``norm.weight``, ``lm_head.weight``        the same ([V_d, H])
``d2t [V_d]`` int, ``t2d [V]`` bool        the same; both absent: the full vocabulary
                                          (the EAGLE code deletes them, speculators
                                          registers them as None)
``input_norm.weight [k*H_t]``              the same (``norm_before_fc``)
``fc_norm.{i}.weight [H_t]``               the same (``fc_norm``, EAGLE-3.1)
``P self_attn.{q,k,v,o}_proj.bias``        ``layer.*`` (the ones the file holds)
========================================  ===========================================

The variants (:mod:`speclab.families.eagle.model3`'s table) are read per format, as the code
that writes each format computes them (:func:`variant_fields`): speculators'
``norm_before_residual``, ``norm_before_fc``, ``fc_norm`` and ``norm_output`` (the
normed state fed back: Eagle3DraftModel, vLLM); SpecForge's ``fc_norm`` and
``norm_output`` (THERE: whether the LM head reads ``norm(out)``, default true; what is
fed back is always ``out``); ``target_hidden_size`` ``H_t`` in both (fc reads
``k * H_t``; the drafter's own embedding is ``[V, H]`` and must be in the file when
``H_t != H``). Attention biases are the ones the weight file holds (q/k/v biases, all three
or none, and an o_proj bias; :func:`attention_biases`), whatever ``attention_bias`` /
``qkv_bias`` say: no EAGLE-3 runtime reads ``qkv_bias`` as q/k/v-only (vLLM's qkv_proj
takes ``attention_bias``, speculators' HF LLaMA layer ignores ``qkv_bias``) and SpecForge
and the EAGLE code build no biases whatever the config says. A research config's
``num_hidden_layers`` is ignored when the file holds the one ``midlayer`` (the EAGLE code
always builds one layer); more layers are refused.

Writing (:func:`public_problem`): speculators' layout takes every variant but SpecForge's
``norm_output: false`` (``head_norm``), attention biases other than all four or none, and
``target_hidden_size != hidden_size`` (speculators 0.9.0 sizes ``fc`` by ``hidden_size``);
the research layout (the EAGLE code's ``cnets.py``, SGLang) takes ``target_hidden_size``
alone: ``cnets.py`` has no ``fc_norm``, ``input_norm`` or biases (``bias=False``) and
always computes ``lm_head(norm(h))``, and ``ea_model.py`` loads with ``strict=False``, so
such tensors would be dropped silently.

The target states ``fc`` reads are named by target layer (speclab's indices,
:mod:`speclab.decoding.features`: ``i`` is the INPUT of decoder layer ``i``):

- ``eagle_aux_hidden_state_layer_ids`` (top level; speculators, vLLM): vLLM captures
  ``hidden_states + residual`` BEFORE decoder layer ``i`` -> speclab ``i``;
- ``eagle_config.eagle_aux_hidden_state_layer_ids`` (SpecForge, SGLang): the OUTPUT of
  decoder layer ``i`` (SpecForge hooks ``layers[i]``'s output, SGLang captures before
  layer ``i + 1``) -> speclab ``i + 1``;
- neither: EAGLE-3's default ``(2, L // 2, L - 3)`` of a target of ``L`` layers (the
  EAGLE code's ``idx == 2 or idx == L // 2 or idx == L - 3`` before layer ``idx``; vLLM's
  and SGLang's default).

vLLM and SGLang concatenate the states in ascending layer order, each once, whatever
order the ids are listed in, so speclab reads them sorted and refuses repeats; the final
norm's output (speclab's index ``L``) is captured by none of them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from speclab.families.eagle.model import EagleMeta
from speclab.models.formats.eagle_layers import check_target_shape
from speclab.models.formats.files import DrafterFormatError, TargetParts, fail, shape

#: EAGLE-3's decoder layer tensors, under the layer's prefix (public and speclab alike)
LAYER_KEYS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
              "self_attn.v_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
              "mlp.up_proj.weight", "mlp.down_proj.weight", "hidden_norm.weight",
              "input_layernorm.weight", "post_attention_layernorm.weight")
#: the public layer prefix of the EAGLE research code / SpecForge and of speculators
RESEARCH_PREFIX, SPECULATORS_PREFIX = "midlayer.", "layers.0."
#: where public configs name the target layers (see the module docstring)
VLLM_IDS, SGLANG_IDS = "eagle_aux_hidden_state_layer_ids", "eagle_config"


def _id_list(value, where: Path, field: str, name: str) -> list[int]:
    if (not isinstance(value, list) or not value
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in value)):
        raise fail(field, where, f"{name}={value!r}: a non-empty list of layer indices is "
                   f"needed")
    return list(value)


def named_layers(cfg: dict, where: Path, field: str, sglang: bool = True
                 ) -> tuple[int, ...] | None:
    """The target states (speclab indices, ascending) a public EAGLE-3 ``cfg`` names:
    top-level ``eagle_aux_hidden_state_layer_ids`` as they are, ``eagle_config``'s
    (``sglang``: the research / SpecForge format) plus one; None when it names none.
    Repeats, negative indices and the two disagreeing are errors naming the field."""
    found = {}  # name -> (as written, speclab indices)
    if cfg.get(VLLM_IDS) is not None:
        ids = _id_list(cfg[VLLM_IDS], where, field, VLLM_IDS)
        found[VLLM_IDS] = (ids, ids)
    inner = cfg.get(SGLANG_IDS)
    if sglang and isinstance(inner, dict) and inner.get(VLLM_IDS) is not None:
        name = f"{SGLANG_IDS}.{VLLM_IDS}"
        ids = _id_list(inner[VLLM_IDS], where, field, name)
        found[name] = (ids, [i + 1 for i in ids])
    if not found:
        return None
    if len({tuple(sorted(mine)) for _, mine in found.values()}) > 1:
        raise fail(field, where, f"{VLLM_IDS}={found[VLLM_IDS][0]} (the input of those "
                   f"decoder layers, vLLM) and {SGLANG_IDS}.{VLLM_IDS}="
                   f"{found[f'{SGLANG_IDS}.{VLLM_IDS}'][0]} (the output of those layers, "
                   f"SpecForge / SGLang) name different target states")
    name, (raw, ids) = next(iter(found.items()))
    if len(set(ids)) != len(ids) or min(ids) < 0:
        raise fail(field, where, f"{name}={raw}: repeated or negative layer ids (vLLM and "
                   f"SGLang capture each layer once, in ascending order)")
    return tuple(sorted(ids))


def resolve_layers(named: tuple[int, ...] | None, config, where: Path, field: str,
                   advice: str = "") -> tuple[int, ...]:
    """The feature layers of a public EAGLE-3 drafter for a target with HF ``config``:
    ``named`` (checked to be decoder-layer inputs of the target) or EAGLE-3's default
    for its depth. Without ``config`` only named layers resolve; a default that is not
    strictly ascending (targets of fewer than 7 layers) has no public equivalent."""
    from speclab.decoding.features import num_decoder_layers

    if config is None:
        if named is None:
            raise fail(field, where, f"names no target layers ({VLLM_IDS} / "
                       f"{SGLANG_IDS}.{VLLM_IDS}), and no target was given to take "
                       f"EAGLE-3's default (2, L // 2, L - 3) from{advice}")
        return named
    depth = num_decoder_layers(config)
    if named is None:  # the public formula itself (speclab's default differs below L = 7)
        ids = (2, depth // 2, depth - 3)
        if list(ids) != sorted(set(ids)) or ids[0] < 0:
            raise fail(field, where, f"names no target layers, and EAGLE-3's default for "
                       f"a target of {depth} layers, (2, L // 2, L - 3) = {ids}, repeats a "
                       f"layer or is out of order (the public code captures each layer once, "
                       f"in ascending order: not what fc was given)")
        return ids
    bad = [i for i in named if i >= depth]
    if bad:
        raise fail(field, where, f"names target layers {bad} (as the input of decoder layer "
                   f"i), but the target has {depth} decoder layers (0..{depth - 1})")
    return named


def draft_vocab(cfg_value, lm_rows: int, vocab: int, where: Path, weights: Path,
                field: str, name: str = "draft_vocab_size") -> int:
    """``V_d``: the config's ``draft_vocab_size`` (None: the LM head's rows), checked
    against the LM head and the target's vocabulary."""
    vd = lm_rows if cfg_value is None else cfg_value
    if not isinstance(vd, int) or isinstance(vd, bool) or not 0 < vd <= vocab:
        raise fail(field, where, f"{name}={cfg_value!r}: a positive integer up to the "
                   f"vocabulary ({vocab}) is needed")
    if vd != lm_rows:
        raise fail(field, weights, f"lm_head.weight has {lm_rows} rows, but {where.name} "
                   f"has {name}={vd}")
    return vd


def _vocab_maps(d2t: torch.Tensor, t2d: torch.Tensor, vocab: int, file: Path,
                field: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``d2t`` checked (integer; ``arange + d2t`` distinct target ids; zero for a full
    vocabulary) and the ``t2d`` that goes with it; the file's ``t2d`` must be that (or,
    for a full vocabulary, all false: the EAGLE code's untouched buffer)."""
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool or d2t.ndim != 1:
        raise fail(field, file, f"d2t has dtype {d2t.dtype} and shape {shape(d2t)}: an "
                   f"integer [draft_vocab_size] offset is needed")
    d2t = d2t.long()
    ids = torch.arange(d2t.shape[0]) + d2t
    if ids.min() < 0 or ids.max() >= vocab or ids.unique().numel() != ids.numel():
        raise fail(field, file, f"d2t maps draft ids to target ids outside [0, {vocab}) or "
                   f"to one target id twice (target id = draft id + d2t[draft id])")
    if d2t.shape[0] == vocab and bool(d2t.any()):
        raise fail(field, file, "d2t permutes the full vocabulary (draft_vocab_size = "
                   "vocab_size): the EAGLE code ignores d2t then, vLLM applies it")
    want = torch.zeros(vocab, dtype=torch.bool)
    want[ids] = True
    if t2d.ndim != 1 or t2d.shape[0] != vocab:
        raise fail(field, file, f"t2d has shape {shape(t2d)}, expected [{vocab}] (the "
                   f"target's vocabulary)")
    if not torch.equal(t2d.bool(), want) and not (d2t.shape[0] == vocab and not t2d.any()):
        raise fail(field, file, "t2d does not mark the target ids d2t maps the draft "
                   "vocabulary to")
    return d2t, want


#: the attention biases a public EAGLE-3 layer may hold, under its prefix
QKV_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
O_BIAS = "self_attn.o_proj.bias"


def attention_biases(tensors: dict, prefix: str, file: Path, field: str) -> dict:
    """The meta's ``qkv_bias`` / ``o_bias`` from the tensors the file holds under
    ``prefix`` (the config's ``attention_bias`` / ``qkv_bias`` are not read: module
    docstring); q/k/v biases that do not come all three are an error naming the missing
    one."""
    have = [k for k in QKV_BIASES if prefix + k in tensors]
    if have and len(have) < len(QKV_BIASES):
        missing = next(k for k in QKV_BIASES if prefix + k not in tensors)
        raise fail(field, file, f"holds {prefix}{have[0]} but no {prefix}{missing}: the "
                   f"q/k/v biases come together (vLLM's qkv_proj has one bias over the three)")
    return {"qkv_bias": bool(have), "o_bias": prefix + O_BIAS in tensors}


def layer_keys(meta: EagleMeta) -> tuple[str, ...]:
    """The layer's tensor names (under its prefix) for ``meta``: :data:`LAYER_KEYS` plus
    the attention biases it has."""
    bias = (QKV_BIASES if meta.qkv_bias else ()) + ((O_BIAS,) if meta.o_bias else ())
    return LAYER_KEYS + bias


def fused_norm_keys(meta: EagleMeta) -> tuple[str, ...]:
    """The top-level norm tensors before ``fc`` (``input_norm.weight`` for
    ``norm_before_fc``, ``fc_norm.{i}.weight`` for ``fc_norm``)."""
    if meta.fc_input_norm:
        return ("input_norm.weight",)
    if meta.fc_state_norms:
        return tuple(f"fc_norm.{i}.weight" for i in range(len(meta.feature_layers or ())))
    return ()


def _leftover_problem(left: list[str], prefix: str) -> str:
    """What the tensors a drafter does not have tell about the variant that wrote them."""
    if any(k.startswith("fc_norm.") for k in left):
        return ("fc_norm.* (EAGLE-3.1's norm per fused target state), but config.json does "
                "not set fc_norm: true")
    if "input_norm.weight" in left:
        return ("input_norm.weight (norm_before_fc's norm over the fused target states), "
                "but config.json does not set norm_before_fc: true")
    layers = sorted({k.split(".")[0] + "." + k.split(".")[1] for k in left
                     if k.count(".") > 1 and k.split(".")[1].isdigit()})
    if layers:
        return (f"more decoder layers than the one {prefix}* ({layers[:3]}): a multi-layer "
                f"EAGLE-3 drafter, which speclab's (one layer) does not compute")
    return (f"tensors an EAGLE-3 drafter (one {prefix}* layer) does not have: "
            f"{left[:5]}{' ...' if len(left) > 5 else ''}")


def assemble(meta: EagleMeta, tensors: dict[str, torch.Tensor], prefix: str, file: Path,
             field: str, target: TargetParts | None, advice: str = ""):
    """An :class:`~speclab.families.eagle.model3.Eagle3Model` from public EAGLE-3 tensors (the
    module docstring's table, layer under ``prefix``); ``embed_tokens.weight`` absent:
    ``target``'s (refused when the drafter is narrower than the target,
    ``target_hidden_size``); ``d2t`` and ``t2d`` both absent: the full vocabulary.
    Missing tensors, leftovers and wrong shapes are errors naming ``file``, the tensor and
    the shape found."""
    from speclab.families.eagle.model3 import Eagle3Model

    tensors = dict(tensors)
    if "embed_tokens.weight" not in tensors:
        if meta.target_hidden_size and meta.target_hidden_size != meta.hidden_size:
            raise fail(field, file, f"has no embed_tokens.weight, and the drafter's "
                       f"hidden_size={meta.hidden_size} is not the target's "
                       f"(target_hidden_size={meta.target_hidden_size}): the target's "
                       f"embedding cannot stand in for the drafter's own (vLLM and the EAGLE "
                       f"code need it in the checkpoint too)")
        if target is None:
            raise fail(field, file, f"has no embed_tokens.weight: this checkpoint takes the "
                       f"target's embedding, and no target was given{advice}")
        tensors["embed_tokens.weight"] = target.embed
    maps = [k for k in ("d2t", "t2d") if k in tensors]
    full = (meta.draft_vocab_size or meta.vocab_size) == meta.vocab_size
    if len(maps) == 1:
        raise fail(field, file, f"holds {maps[0]} without {({'d2t', 't2d'} - set(maps)).pop()}"
                   f" (the draft vocabulary's two maps come together)")
    if not maps and not full:
        raise fail(field, file, f"has no d2t / t2d, but the draft vocabulary "
                   f"({meta.draft_vocab_size}) is smaller than the target's "
                   f"({meta.vocab_size}): which target ids it holds is unknown")
    state = {"embed.weight": tensors.pop("embed_tokens.weight")}
    names = {"fc.weight": "fc.weight", "norm.weight": "norm.weight",
             "lm_head.weight": "lm_head.weight"}
    names.update({k: k for k in maps})
    if meta.fc_bias:
        names["fc.bias"] = "fc.bias"
    names.update({k: k for k in fused_norm_keys(meta)})
    names.update({f"{prefix}{k}": f"layer.{k}" for k in layer_keys(meta)})
    for public, mine in names.items():
        if public not in tensors:
            raise fail(field, file, f"has no {public} (a tensor of the EAGLE-3 drafter)")
        state[mine] = tensors.pop(public)
    if tensors:
        raise fail(field, file, f"holds {_leftover_problem(sorted(tensors), prefix)}")
    model = Eagle3Model(meta)
    want = {k: t.shape for k, t in model.state_dict().items()}
    if not maps:  # the full vocabulary: identity maps
        state["d2t"], state["t2d"] = model.d2t.clone(), model.t2d.clone()
    public_of = {mine: public for public, mine in names.items()}
    public_of["embed.weight"] = "embed_tokens.weight (or the target's embedding)"
    th = meta.target_hidden_size or meta.hidden_size
    for name, t in state.items():
        if t.shape != want[name]:
            raise fail(field, file, f"{public_of[name]} has shape {shape(t)}, expected "
                       f"{list(want[name])} for hidden_size={meta.hidden_size}, vocab_size="
                       f"{meta.vocab_size}, draft_vocab_size="
                       f"{meta.draft_vocab_size or meta.vocab_size}, "
                       f"{len(meta.feature_layers)} target layers of width {th} and the "
                       f"config's layer shape")
    state["d2t"], state["t2d"] = _vocab_maps(state["d2t"], state["t2d"], meta.vocab_size,
                                             file, field)
    missing = sorted(set(want) - set(state))
    if missing:
        raise DrafterFormatError(f"{field}: internal: tensors not filled: {missing}")
    with torch.no_grad():
        model.load_state_dict({k: t if k in ("d2t", "t2d") else t.float()
                               for k, t in state.items()})
    return model


def build(cfg: dict, fields: dict, named, tensors: dict, prefix: str, arch: str,
          where: Path, weights: Path, field: str, target: TargetParts | None,
          target_config, advice: str, field_prefix: str = "", variant: dict | None = None):
    """The shared tail of both EAGLE-3 readers: shapes against the target, the target
    layers (``named`` or the default), the draft vocabulary, then :func:`assemble`
    (``fields``: the LLaMA fields of :func:`~.eagle_layers.llama_fields`;
    ``field_prefix``: where they sit in ``config.json``, for messages; ``variant``: the
    meta fields of :func:`variant_fields`)."""
    variant = {**(variant or {}), **attention_biases(tensors, prefix, weights, field)}
    config = target.config if target is not None else target_config
    if config is not None:  # before anything is looked for: the shapes come first
        check_target_shape(EagleMeta(target_architecture="", **fields, **variant), config,
                           where, field, (f"{field_prefix}hidden_size",
                                          f"{field_prefix}vocab_size"))
    th = variant.get("target_hidden_size") or fields["hidden_size"]
    k = fc_layers(tensors.get("fc.weight"), fields["hidden_size"], weights, field, th)
    ids = resolve_layers(named, config, where, field, advice)
    check_width(ids, k, weights, field)
    if th != fields["hidden_size"] and k * th == fields["hidden_size"]:
        raise fail(field, where, f"target_hidden_size={th}: {k} fused target states are "
                   f"then as wide as the drafter's own state (hidden_size="
                   f"{fields['hidden_size']}), which speclab's drafter tells apart by width")
    head = tensors.get("lm_head.weight")
    if head is None or head.ndim != 2:
        raise fail(field, weights, "has no lm_head.weight [draft_vocab_size, hidden_size] "
                   "(EAGLE-3's own LM head over the draft vocabulary)")
    v = fields["vocab_size"]
    vd = draft_vocab(cfg.get("draft_vocab_size"), int(head.shape[0]), v, where, weights, field)
    meta = EagleMeta(target_architecture=arch, layers=1, fc_bias="fc.bias" in tensors,
                     version=3, feature_layers=ids, draft_vocab_size=0 if vd == v else vd,
                     **fields, **variant)
    return assemble(meta, tensors, prefix, weights, field, target, advice)


def fc_layers(fc: torch.Tensor | None, hidden: int, file: Path, field: str,
              target_hidden: int | None = None) -> int:
    """How many target states ``fc.weight`` ``[H, k*H_t]`` fuses (``k``; ``H_t``:
    ``target_hidden``, default ``H``)."""
    th = target_hidden or hidden
    if fc is None:
        raise fail(field, file, "has no fc.weight (the fusion of the target's states)")
    if fc.ndim != 2 or fc.shape[0] != hidden or fc.shape[1] % th:
        width = "hidden_size" if th == hidden else "target_hidden_size"
        raise fail(field, file, f"fc.weight has shape {shape(fc)}, expected [{hidden}, k * "
                   f"{th}] (hidden_size={hidden}, k target states of {width}={th})")
    return fc.shape[1] // th


def check_width(layers: tuple[int, ...], k: int, file: Path, field: str) -> None:
    """fc's ``k`` states must be the ``len(layers)`` the config names (or the default)."""
    if k != len(layers):
        raise fail(field, file, f"fc.weight fuses {k} target states, but the drafter reads "
                   f"{len(layers)} target layers {list(layers)}")


def public_tensors(model, prefix: str, vocab_maps: bool = True) -> dict[str, torch.Tensor]:
    """``model``'s (an Eagle3Model) tensors under the public names, layer under ``prefix``
    (float32 weights, int64 ``d2t``, bool ``t2d``; without ``vocab_maps``, none for a
    full-vocabulary drafter), contiguous on the CPU."""
    out = {}
    full = not model.meta.draft_vocab_size
    for name, t in model.state_dict().items():
        if name in ("d2t", "t2d") and full and not vocab_maps:
            continue
        t = t.detach().cpu().contiguous()
        if name == "embed.weight":
            name = "embed_tokens.weight"
        elif name.startswith("layer."):
            name = prefix + name.removeprefix("layer.")
        out[name] = t if name in ("d2t", "t2d") else t.float()
    return out


def public_problem(meta: EagleMeta, fmt: str, num_layers: int | None = None,
                   research: bool = False) -> str | None:
    """Why an EAGLE-3 drafter with ``meta`` cannot be written in a public EAGLE-3 format
    (``fmt``: its name, for messages; ``research``: the EAGLE-3 research / SpecForge
    layout, else speculators') exactly (None: it can); ``num_layers``: the target's depth,
    when known (its index ``L`` is then checked)."""
    layers = tuple(meta.feature_layers or ())
    if meta.fc_bias:
        return (f"the drafter's fc has a bias (fc_bias); {fmt}'s fc has none (vLLM's, "
                f"SpecForge's and the EAGLE code's are bias-free)")
    if meta.embed_scale != 1.0:
        return (f"the drafter scales the token embedding by {meta.embed_scale:g} "
                f"(embed_scale); the format has no field for it")
    if len(layers) != 3:
        return (f"the drafter fuses {len(layers)} target layers {list(layers)}; vLLM's, "
                f"SGLang's and the EAGLE code's fc reads exactly 3")
    if list(layers) != sorted(set(layers)):
        return (f"feature_layers {list(layers)} are not strictly ascending: vLLM and SGLang "
                f"concatenate the target's states in ascending layer order, each once")
    if num_layers is not None and layers[-1] > num_layers:
        return (f"feature_layers {list(layers)} reach past the target's {num_layers} layers")
    if num_layers is not None and layers[-1] == num_layers:
        return (f"feature_layers {list(layers)} include {num_layers}, the target's final "
                f"norm output, which no public runtime captures (they read the input of a "
                f"decoder layer)")
    if research:
        return _research_problem(meta, layers)
    if meta.qkv_bias != meta.o_bias:
        which = "q/k/v projections have biases and o_proj none" if meta.qkv_bias \
            else "o_proj has a bias and the q/k/v projections none"
        return (f"the drafter's {which} (qkv_bias={meta.qkv_bias}, o_bias={meta.o_bias}); "
                f"vLLM's and speculators' EAGLE-3 layer reads attention_bias alone (all four "
                f"or none)")
    if not meta.head_norm:
        return (f"the drafter's LM head reads out without the final norm (SpecForge's "
                f"norm_output: false); {fmt} always normalises before the LM head")
    if meta.target_hidden_size and meta.target_hidden_size != meta.hidden_size:
        return (f"target_hidden_size={meta.target_hidden_size} differs from the drafter's "
                f"hidden_size={meta.hidden_size}: speculators 0.9.0 sizes fc (and fc_norm) by "
                f"hidden_size (num_aux * hidden_size inputs), so its loader refuses fc.weight "
                f"[{meta.hidden_size}, {len(layers) * meta.target_hidden_size}] (vLLM reads "
                f"target_hidden_size, but that cannot be checked here); use --format eagle "
                f"(the EAGLE code's cnets.py and SpecForge read target_hidden_size)")
    return None


def _research_problem(meta: EagleMeta, layers: tuple[int, ...]) -> str | None:
    """The variants the EAGLE-3 research layout cannot hold: what the code that reads an
    export in it (the EAGLE code's cnets.py / ea_model.py, SGLang's llama_eagle3.py) does
    not compute."""
    if layers[0] == 0:
        return ("feature_layers include 0, the target's embedding output: SpecForge and "
                "SGLang name the OUTPUT of decoder layer i (eagle_config ids), so it has no "
                "id there (-1; SpecForge refuses negative ids); use --format speculators "
                "(vLLM names it 0)")
    for on, flag, what in ((meta.residual_norm, "norm_before_residual", "the normed residual"),
                           (meta.fc_input_norm, "norm_before_fc",
                            "a norm over the fused target states"),
                           (meta.feed_normed, "norm_output (speculators')",
                            "the normed state fed back")):
        if on:
            return (f"the drafter has {what} ({flag}), which neither the EAGLE code nor "
                    f"SpecForge computes; use --format speculators")
    if meta.qkv_bias or meta.o_bias:
        return (f"the drafter has attention biases (qkv_bias={meta.qkv_bias}, o_bias="
                f"{meta.o_bias}; attention_bias): the EAGLE code's cnets.py builds the EAGLE-3 "
                f"layer's q/k/v/o_proj with bias=False and ea_model.py loads with "
                f"strict=False, so they would be dropped silently; use --format speculators "
                f"(attention_bias: q/k/v/o)")
    if meta.fc_state_norms:
        return ("the drafter normalises each fused target state (fc_state_norms; fc_norm, "
                "EAGLE-3.1): the EAGLE code's cnets.py has no fc_norm (ea_model.py loads with "
                "strict=False, so fc_norm.* would be dropped silently) and SGLang's "
                "llama_eagle3.py has none either; use --format speculators, which carries "
                "fc_norm")
    if not meta.head_norm:
        return ("the drafter's LM head reads the layer's output without the final norm "
                "(head_norm false; SpecForge's norm_output: false): the EAGLE code's cnets.py "
                "and SGLang always compute lm_head(norm(h)), and speculators' format "
                "always normalises before the LM head too: no exported format holds this "
                "drafter (keep speclab's folder)")
    return None


def meta_fields(meta: EagleMeta) -> dict:
    """The EAGLE-3 config fields speclab writes (both public formats): the draft
    vocabulary and the target layers, named both ways (module docstring)."""
    layers = list(meta.feature_layers or ())
    return {"draft_vocab_size": meta.draft_vocab_size or meta.vocab_size,
            VLLM_IDS: layers,
            SGLANG_IDS: {VLLM_IDS: [i - 1 for i in layers], "use_aux_hidden_state": True}}


def _flag(cfg: dict, key: str, where: Path, field: str, default: bool = False) -> bool:
    """A boolean config flag (absent: ``default``); anything but true / false / null is an
    error naming it."""
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise fail(field, where, f"{key}={value!r}: true or false is needed")
    return value


def variant_fields(cfg: dict, hidden: int, where: Path, field: str, research: bool) -> dict:
    """The EAGLE-3 variant meta fields (:mod:`speclab.families.eagle.model3`) a public
    ``cfg`` declares, each flag read as the format's own code reads it (``research``: the
    EAGLE code / SpecForge layout, else speculators'): module docstring. Variants no
    speclab drafter computes are refused naming the flag."""
    inner = cfg.get(SGLANG_IDS)
    if isinstance(inner, dict) and inner.get("use_aux_hidden_state") is False:
        raise fail(field, where, f"{SGLANG_IDS}.use_aux_hidden_state=false: a drafter "
                   f"without the fused target layers (no fc) is not EAGLE-3's")
    th = cfg.get("target_hidden_size")
    if th is not None and (not isinstance(th, int) or isinstance(th, bool) or th <= 0):
        raise fail(field, where, f"target_hidden_size={th!r}: a positive integer (the "
                   f"target's hidden size) or null is needed")
    out = {"target_hidden_size": 0 if th in (None, hidden) else int(th),
           "fc_state_norms": _flag(cfg, "fc_norm", where, field)}
    if research:
        for key, what in (("norm_before_residual", "keeps hidden_norm(h) as the residual"),
                          ("norm_before_fc", "normalises the fused target states before "
                                             "fc")):
            if cfg.get(key):
                raise fail(field, where, f"{key}=true: that variant {what}, which neither "
                           f"the EAGLE code nor SpecForge (this layout's code) computes; "
                           f"speculators' eagle3 format carries it")
        # SpecForge: norm_output switches the final norm before the LM head (default on)
        out["head_norm"] = _flag(cfg, "norm_output", where, field, default=True)
        return out
    out.update(residual_norm=_flag(cfg, "norm_before_residual", where, field),
               fc_input_norm=_flag(cfg, "norm_before_fc", where, field),
               feed_normed=_flag(cfg, "norm_output", where, field))
    if out["fc_input_norm"] and out["fc_state_norms"]:
        raise fail(field, where, "norm_before_fc=true and fc_norm=true: speculators refuses "
                   "the two together (one norm over the fused states, or one per state)")
    return out

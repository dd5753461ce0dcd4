"""The tensors public EAGLE-1/2 checkpoints share, mapped onto speclab's
:class:`~speclab.families.eagle.model.EagleModel` and back.

Both public layouts (the EAGLE research code and speculators' ``eagle``) compute

    ``x = fc(concat(Embed(x_{t+1}), f_t))``  -> LLaMA decoder layer(s) -> the target's LM head

with the EMBEDDING FIRST, where speclab's ``fc`` reads ``concat(f_t, Embed(x_{t+1}))``:
``fc.weight [H, 2H]``'s two column halves swap on the way in and out
(:func:`swap_halves`, its own inverse); the bias is the same. A LLaMA layer's tensors keep
their names under ``layers.<i>.`` (speclab: ``decoder.layers.<i>.``). Layer 0 of EAGLE-1/2
has no input norm and there is no final norm (``EagleMeta.input_norm / final_norm``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from speclab.families.eagle.model import EagleMeta, EagleModel
from speclab.models.formats.files import DrafterFormatError, TargetParts, fail, shape

#: a LLaMA decoder layer's tensors, without ``input_layernorm`` (absent in EAGLE's layer 0)
LAYER_KEYS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
              "self_attn.v_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
              "mlp.up_proj.weight", "mlp.down_proj.weight", "post_attention_layernorm.weight")
INPUT_NORM = "input_layernorm.weight"


def swap_halves(w: torch.Tensor) -> torch.Tensor:
    """``fc.weight [H, 2H]`` over ``concat(a, b)`` -> the same map over ``concat(b, a)``."""
    h = w.shape[1] // 2
    return torch.cat([w[:, h:], w[:, :h]], 1).contiguous()


def layer_names(meta: EagleMeta) -> list[str]:
    """The public names (``layers.<i>.<tensor>``) of ``meta``'s decoder layers."""
    names = []
    for i in range(meta.layers):
        keys = LAYER_KEYS + ((INPUT_NORM,) if i > 0 or meta.input_norm else ())
        names += [f"layers.{i}.{k}" for k in keys]
    return names


def check_target_shape(meta: EagleMeta, config, file: Path, field: str,
                       names: tuple[str, str] = ("hidden_size", "vocab_size")) -> None:
    """A DrafterFormatError naming ``file`` and the field (``names``: how the file calls
    hidden size and vocabulary) when ``config`` (the target's HF config) has another
    hidden size or vocabulary than ``meta`` (an EAGLE-3 drafter's ``target_hidden_size``,
    when set, is the width compared)."""
    hidden = ("target_hidden_size", "target_hidden_size") if meta.target_hidden_size \
        else ("hidden_size", names[0])
    for (mine, theirs), have in zip((hidden, ("vocab_size", names[1])),
                                    (int(config.hidden_size), int(config.vocab_size))):
        if getattr(meta, mine) != have:
            raise fail(field, file, f"{theirs}={getattr(meta, mine)}, but the target has "
                       f"{mine.removeprefix('target_')}={have} (a drafter for another "
                       f"target)")


def assemble(meta: EagleMeta, tensors: dict[str, torch.Tensor], file: Path, field: str,
             target: TargetParts | None, extra: str = "") -> EagleModel:
    """An EagleModel from public tensors: ``fc.weight [H, 2H]`` (embedding first),
    ``fc.bias [H]`` (when ``meta.fc_bias``), :func:`layer_names`, ``norm.weight`` (when
    ``meta.final_norm``), ``embed_tokens.weight [V, H]`` and ``lm_head.weight [V, H]``
    (each from ``tensors``, else from ``target``). Missing tensors, leftovers and wrong
    shapes are errors naming ``file``, the tensor and the shape found (``extra``: the
    format's advice appended to a missing LM head / embedding)."""
    tensors = dict(tensors)
    h, v = meta.hidden_size, meta.vocab_size
    for name, part in (("embed_tokens.weight", "embed"), ("lm_head.weight", "lm_head")):
        if name not in tensors:
            if target is None:
                what = "LM head" if part == "lm_head" else "embedding"
                raise fail(field, file, f"has no {name}: this format takes the target's "
                           f"{what}, and no target was given{extra}")
            tensors[name] = getattr(target, part)
    state = {"embed.weight": tensors.pop("embed_tokens.weight"),
             "lm_head.weight": tensors.pop("lm_head.weight"),
             "fc.weight": tensors.pop("fc.weight", None)}
    if state["fc.weight"] is None:
        raise fail(field, file, "has no fc.weight (the drafter's input projection)")
    if tuple(state["fc.weight"].shape) == (h, 3 * h):
        raise fail(field, file, f"fc.weight has shape {shape(state['fc.weight'])}, a fused "
                   f"fc over three hidden states (EAGLE-3), under EAGLE-1/2's layer names "
                   f"(layers.0.*): EAGLE-3 checkpoints name their layer midlayer.* (EAGLE "
                   f"code, SpecForge) or come with speculators_model_type: eagle3")
    state["fc.weight"] = swap_halves(state["fc.weight"])
    if meta.fc_bias:
        state["fc.bias"] = tensors.pop("fc.bias")
    for name in layer_names(meta):
        if name not in tensors:
            raise fail(field, file, f"has no {name} (a LLaMA decoder layer {name.split('.')[1]}"
                       f" of the {meta.layers} the config declares)")
        state[f"decoder.{name}"] = tensors.pop(name)
    if meta.final_norm:
        state["decoder.norm.weight"] = tensors.pop("norm.weight")
    if tensors:
        left = sorted(tensors)
        raise fail(field, file, f"holds tensors an EAGLE-1/2 drafter with {meta.layers} "
                   f"layer(s) does not have: {left[:5]}{' ...' if len(left) > 5 else ''}")
    model = EagleModel(meta)
    want = {k: t.shape for k, t in model.state_dict().items() if not k.endswith("inv_freq")}
    for name, t in state.items():
        if name not in want:
            raise DrafterFormatError(f"{field}: internal: no parameter {name}")
        if t.shape != want[name]:
            public = _public_name(name)
            raise fail(field, file, f"{public} has shape {shape(t)}, expected "
                       f"{list(want[name])} for hidden_size={h}, vocab_size={v} and the "
                       f"config's layer shape")
    missing = sorted(set(want) - set(state))
    if missing:
        raise DrafterFormatError(f"{field}: internal: tensors not filled: {missing}")
    with torch.no_grad():
        model.load_state_dict({k: t.float() for k, t in state.items()}, strict=False)
    return model


def _public_name(name: str) -> str:
    """speclab's parameter name -> the public one (for messages)."""
    return {"embed.weight": "embed_tokens.weight (or the target's embedding)",
            "lm_head.weight": "lm_head.weight (or the target's LM head)",
            "decoder.norm.weight": "norm.weight"}.get(name, name.removeprefix("decoder."))


def public_tensors(model: EagleModel, embedding: bool = True) -> dict[str, torch.Tensor]:
    """``model``'s tensors under the public names (fc embedding-first, ``layers.<i>.*``,
    ``embed_tokens.weight`` when ``embedding``; no LM head: both formats share the
    target's), contiguous on the CPU. The caller has checked the layout fits."""
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().contiguous().cpu()
        if name.endswith("inv_freq") or name == "lm_head.weight":
            continue
        if name == "embed.weight":
            if embedding:
                out["embed_tokens.weight"] = t
        elif name == "fc.weight":
            out[name] = swap_halves(t)
        elif name.startswith("decoder."):
            out[name.removeprefix("decoder.")] = t
        else:
            out[name] = t
    return out


def llama_fields(cfg: dict, file: Path, field: str, prefix: str = "",
                 bias_from_tensors: bool = False) -> dict:
    """The :class:`EagleMeta` fields a LLaMA-style config dict gives (``prefix``: where
    the dict sits in its file, for messages): sizes, heads, RoPE, norm epsilon. Values
    speclab's LLaMA layer cannot hold (another activation, MLP biases, attention biases)
    are errors naming the field. With ``bias_from_tensors`` (the EAGLE-3 layer) the
    config's ``attention_bias`` / ``qkv_bias`` are not read at all: the runtimes disagree
    on them (vLLM's qkv_proj takes ``attention_bias``, speculators' HF LLaMA layer ignores
    ``qkv_bias``, SpecForge and the EAGLE code build no biases), so the EAGLE-3 readers
    take the biases the weight file holds (:func:`.eagle3_layers.attention_biases`)."""
    def need(key: str) -> int:
        if not isinstance(cfg.get(key), int) or cfg[key] <= 0:
            raise fail(field, file, f"{prefix}{key}={cfg.get(key)!r}: a positive integer "
                       f"is needed")
        return int(cfg[key])

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise fail(field, file, f"{prefix}hidden_act={act!r}: speclab's LLaMA layer uses "
                   f"silu")
    for key in ("mlp_bias",) if bias_from_tensors else ("attention_bias", "mlp_bias",
                                                         "qkv_bias"):
        if cfg.get(key):
            raise fail(field, file, f"{prefix}{key}={cfg[key]!r}: speclab's LLaMA layer has "
                       f"no biases in its projections")
    kv = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    rope = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling")
    if scaling is None and rope.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return {"hidden_size": hidden, "vocab_size": need("vocab_size"), "heads": heads,
            "kv_heads": 0 if kv == heads else kv,
            "head_dim": 0 if head_dim == hidden // heads else head_dim,
            "intermediate_size": need("intermediate_size"), "rope_theta": float(theta),
            "rope_scaling": dict(scaling) if scaling else None,
            "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
            "max_positions": int(cfg.get("max_position_embeddings", 2048))}


def llama_config_dict(meta: EagleMeta, layers: int) -> dict:
    """A LLaMA config dict for ``meta``'s layers (the inverse of :func:`llama_fields`)."""
    out = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           "vocab_size": meta.vocab_size, "hidden_size": meta.hidden_size,
           "intermediate_size": meta.intermediate_size, "num_hidden_layers": layers,
           "num_attention_heads": meta.heads,
           "num_key_value_heads": meta.kv_heads or meta.heads,
           "head_dim": meta.head_dim or meta.hidden_size // meta.heads,
           "hidden_act": "silu", "max_position_embeddings": meta.max_positions,
           "rms_norm_eps": meta.rms_norm_eps, "rope_theta": meta.rope_theta,
           "rope_scaling": dict(meta.rope_scaling) if meta.rope_scaling else None,
           "attention_bias": meta.qkv_bias and meta.o_bias, "mlp_bias": False,
           "tie_word_embeddings": False,
           "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
    return out

"""What the EAGLE research code builds and loads, as key -> shape tables, from a drafter
folder's ``config.json`` (the values EAGLE's ``EConfig`` reads).

Written from SafeAILab/EAGLE at commit cb7e0841fe0c206c6ed74a197ad5e2a1f13f5a2b
(2026-02-19):

- ``eagle/model/cnets.py`` ``Model`` (EAGLE-3): ``embed_tokens`` ``nn.Embedding(vocab_size,
  hidden_size)``; ``lm_head`` ``nn.Linear(hidden_size, draft_vocab_size, bias=False)``;
  ``midlayer`` = ``LlamaDecoderLayeremb``: ``self_attn`` (``q_proj`` / ``k_proj`` /
  ``v_proj`` read ``hidden_size * 2``, ``head_dim = hidden_size // num_attention_heads``,
  no biases), ``mlp`` (``gate_proj`` / ``up_proj`` / ``down_proj``, no biases),
  ``hidden_norm``, ``input_layernorm``, ``post_attention_layernorm`` (``LlamaRMSNorm``:
  ``weight [hidden_size]``); ``fc`` ``nn.Linear(3 * target_hidden_size`` (when the config
  has that key, else ``3 * hidden_size``) ``, hidden_size, bias=False)``; ``norm``;
  buffers ``d2t`` ``[draft_vocab_size]`` int64 and ``t2d`` ``[vocab_size]`` bool. The
  rotary embeddings' buffers are ``persistent=False`` (not in the state dict).
- ``eagle/model/cnets1.py`` ``Model`` (EAGLE-1/2): ``embed_tokens``; ``layers`` =
  ``num_hidden_layers`` ``LlamaDecoderLayer(config, index)``: ``self_attn`` (``q_proj`` /
  ``k_proj`` / ``v_proj`` read ``hidden_size``, with biases when the config has
  ``qkv_bias``), ``mlp``, ``post_attention_layernorm``, and ``input_layernorm`` only for
  ``index != 0``; ``fc`` ``nn.Linear(2 * hidden_size, hidden_size, bias=bias)`` (``bias``:
  the config's ``bias``, default True). No final norm, no LM head (the target's is used).
- ``eagle/model/ea_model.py`` ``EaModel``: reads ``pytorch_model.bin`` (else
  ``model.safetensors``), builds the model with ``load_emb=True`` (the embedding copied
  from the base model: EAGLE-1/2 always, EAGLE-3 only when the config has no
  ``target_hidden_size``), deletes ``d2t`` / ``t2d`` when ``vocab_size ==
  draft_vocab_size``, then ``load_state_dict(state, strict=False)`` and ignores the
  result: a missing key stays at its random initial value and an unknown key is dropped,
  both silently, so a file must hold exactly the keys below (what the loader itself
  fills or deletes being the only latitude: :func:`eagle3_tolerated`,
  :func:`eagle_tolerated`).
"""

from __future__ import annotations

#: the config.json fields the EAGLE code reads (EConfig, cnets*.py) and their types
CONFIG_FIELDS = {"hidden_size": int, "intermediate_size": int, "num_attention_heads": int,
                 "num_key_value_heads": int, "num_hidden_layers": int, "vocab_size": int,
                 "rms_norm_eps": float, "hidden_act": str, "max_position_embeddings": int}

#: LLaMA MLP weights (cnets*.py LlamaMLP), as functions of (hidden, intermediate)
_MLP = {"mlp.gate_proj.weight": lambda h, i: (i, h), "mlp.up_proj.weight": lambda h, i: (i, h),
        "mlp.down_proj.weight": lambda h, i: (h, i)}


def _attention(prefix: str, cfg: dict, width: int, bias: bool) -> dict[str, tuple]:
    """cnets*.py LlamaAttention's weights under ``prefix``: q/k/v read ``width``."""
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // heads
    out = {f"{prefix}self_attn.q_proj.weight": (heads * hd, width),
           f"{prefix}self_attn.k_proj.weight": (kv * hd, width),
           f"{prefix}self_attn.v_proj.weight": (kv * hd, width),
           f"{prefix}self_attn.o_proj.weight": (h, heads * hd)}
    if bias:
        out.update({f"{prefix}self_attn.q_proj.bias": (heads * hd,),
                    f"{prefix}self_attn.k_proj.bias": (kv * hd,),
                    f"{prefix}self_attn.v_proj.bias": (kv * hd,)})
    return out


def config_problems(cfg: dict, eagle3: bool) -> list[str]:
    """What in ``cfg`` (a drafter folder's config.json) the EAGLE code could not build
    from: a missing or mistyped field it reads, a ``hidden_size`` its attention refuses,
    a ``rope_scaling`` it does not know, a null ``target_hidden_size``."""
    problems = [f"{k}: {cfg.get(k)!r} is not {t.__name__}" for k, t in CONFIG_FIELDS.items()
                if not isinstance(cfg.get(k), t) or isinstance(cfg.get(k), bool)]
    if problems:
        return problems
    if cfg["hidden_size"] % cfg["num_attention_heads"]:
        problems.append("hidden_size is not a multiple of num_attention_heads "
                        "(LlamaAttention raises)")
    scaling = cfg.get("rope_scaling")
    if scaling is not None and (scaling.get("type") not in ("linear", "dynamic")
                                or "factor" not in scaling):
        problems.append(f"rope_scaling {scaling!r}: _init_rope reads type linear / dynamic "
                        f"and factor")
    if eagle3:
        if not isinstance(cfg.get("draft_vocab_size"), int):
            problems.append(f"draft_vocab_size: {cfg.get('draft_vocab_size')!r} (lm_head rows)")
        if "target_hidden_size" in cfg and not isinstance(cfg["target_hidden_size"], int):
            problems.append(f"target_hidden_size: {cfg['target_hidden_size']!r} (fc reads "
                            f"3 * target_hidden_size when the key exists)")
        if cfg["num_hidden_layers"] != 1:
            problems.append("num_hidden_layers != 1: cnets.py builds one midlayer")
    return problems


def eagle3_state(cfg: dict) -> dict[str, tuple]:
    """cnets.py ``Model(config)``'s state dict, key -> shape."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    fc_in = 3 * (cfg["target_hidden_size"] if "target_hidden_size" in cfg else h)
    out = {"embed_tokens.weight": (cfg["vocab_size"], h),
           "lm_head.weight": (cfg["draft_vocab_size"], h),
           "fc.weight": (h, fc_in), "norm.weight": (h,),
           "d2t": (cfg["draft_vocab_size"],), "t2d": (cfg["vocab_size"],)}
    out.update(_attention("midlayer.", cfg, 2 * h, bias=False))
    out.update({f"midlayer.{k}": f(h, inter) for k, f in _MLP.items()})
    for norm in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
        out[f"midlayer.{norm}.weight"] = (h,)
    return out


def eagle3_tolerated(cfg: dict) -> tuple[set[str], set[str]]:
    """(keys the file may lack, keys it may hold beyond :func:`eagle3_state`) as
    ea_model.py loads an EAGLE-3 drafter: the embedding when ``load_emb`` copies the
    base model's (no ``target_hidden_size`` in the config); ``d2t`` / ``t2d`` either way
    when the vocabulary is the target's (deleted before the load)."""
    may_lack, may_hold = set(), set()
    if "target_hidden_size" not in cfg:
        may_lack.add("embed_tokens.weight")
    if cfg["vocab_size"] == cfg["draft_vocab_size"]:
        may_lack |= {"d2t", "t2d"}
    return may_lack, may_hold


def eagle_state(cfg: dict) -> dict[str, tuple]:
    """cnets1.py ``Model(config, bias=cfg.get("bias", True))``'s state dict, key -> shape."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    out = {"embed_tokens.weight": (cfg["vocab_size"], h), "fc.weight": (h, 2 * h)}
    if cfg.get("bias", True):
        out["fc.bias"] = (h,)
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        out.update(_attention(p, cfg, h, bias=bool(cfg.get("qkv_bias", False))))
        out.update({p + k: f(h, inter) for k, f in _MLP.items()})
        out[p + "post_attention_layernorm.weight"] = (h,)
        if i != 0:
            out[p + "input_layernorm.weight"] = (h,)
    return out


def eagle_tolerated(cfg: dict) -> tuple[set[str], set[str]]:
    """(keys the file may lack, keys it may hold beyond :func:`eagle_state`) as
    ea_model.py loads an EAGLE-1/2 drafter: the embedding (``load_emb`` copies the base
    model's); nothing extra."""
    del cfg
    return {"embed_tokens.weight"}, set()


def layout_problems(state: dict[str, tuple], cfg: dict, eagle3: bool) -> list[str]:
    """Every difference between ``state`` (a file's key -> shape) and what the EAGLE code
    builds from ``cfg``, beyond what its loader tolerates; [] when the file fits."""
    problems = config_problems(cfg, eagle3)
    if problems:
        return problems
    want = eagle3_state(cfg) if eagle3 else eagle_state(cfg)
    may_lack, may_hold = (eagle3_tolerated if eagle3 else eagle_tolerated)(cfg)
    problems += [f"missing {k} {want[k]}" for k in sorted(set(want) - set(state) - may_lack)]
    problems += [f"unexpected {k} {state[k]}" for k in sorted(set(state) - set(want) - may_hold)]
    problems += [f"{k}: {tuple(state[k])} != {want[k]}" for k in sorted(set(want) & set(state))
                 if tuple(state[k]) != want[k]]
    return problems

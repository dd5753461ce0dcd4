"""The speculators format (vllm-project/speculators), ``speculators_model_type: eagle``:
the EAGLE-1/2 / HASS drafter that vLLM serves from a folder
(``vllm serve DRAFTER_FOLDER`` reads the target from the config).

``config.json``::

    {"architectures": ["EagleSpeculator", "LlamaDecoderLayer"],
     "speculators_model_type": "eagle",
     "transformer_layer_architecture": "LlamaDecoderLayer",
     "transformer_layer_config": {<a LLaMA config: model_type, vocab_size, hidden_size,
         intermediate_size, num_hidden_layers 1, num_attention_heads, num_key_value_heads,
         head_dim, hidden_act, rms_norm_eps, rope_theta, rope_scaling,
         max_position_embeddings, ...>},
     "layernorms": false, "fusion_bias": <fc has a bias>,
     "speculators_config": {"algorithm": "eagle",
         "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": N,
                               "verifier_accept_k": 1, "accept_tolerance": 0.0}],
         "default_proposal_method": "greedy",
         "verifier": {"name_or_path": TARGET, "architectures": [TARGET_ARCH]}}}

No top-level ``model_type``: vLLM picks its speculators config class from the presence of
``speculators_config`` when ``model_type`` is absent.

``model.safetensors``: ``fusion_fc.weight [H, 2H]`` over ``concat(Embed, f)``,
``fusion_fc.bias`` (with ``fusion_bias``), ``transformer.<LLaMA decoder layer tensors>``
(one layer; with ``layernorms: false`` its ``input_layernorm`` is an identity and there is
no ``pre_lm_head_layernorm``). Embedding and LM head are the verifier's (speculators
leaves them out on save; vLLM shares the target's). ``layernorms: true`` adds
``embedding_layernorm`` on the token embedding, ``transformer.input_layernorm`` and
``pre_lm_head_layernorm``: speclab has no embedding norm, so that variant is refused on
import, and a speclab drafter with its own two norms cannot be written exactly.

What vLLM reads of such a config (checked by the tests): :data:`VLLM_READS`.

``speculators_model_type: eagle3`` (speculators' ``Eagle3SpeculatorConfig`` /
``Eagle3DraftModel``, vLLM's ``Eagle3LlamaForCausalLM``)::

    {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
     "transformer_layer_config": {<the LLaMA config of the drafter's layer; vocab_size is
         the TARGET's vocabulary>},
     "draft_vocab_size": V_d, "norm_before_residual": false, "norm_before_fc": false,
     "target_hidden_size": H, "eagle_aux_hidden_state_layer_ids": [a, b, c],
     "speculators_config": {"algorithm": "eagle3", <as above>}}

``model.safetensors``: ``fc.weight [H, 3H]`` (old speculators: also ``fc.bias``),
``layers.0.{self_attn,mlp}.*``, ``layers.0.{hidden_norm,input_layernorm,
post_attention_layernorm}.weight``, ``norm.weight``, ``lm_head.weight [V_d, H]``,
``d2t [V_d]``, ``t2d [V]``, optionally ``embed_tokens.weight`` (absent: the verifier's;
speclab always writes it, so the export is the drafter exactly). The mapping is
:mod:`.eagle3_layers`'. Refused by name: ``norm_before_residual: true`` (the residual
is ``hidden_norm(h)``, not ``h``) and an absent one (speculators reads false, vLLM
true), ``norm_before_fc: true``, ``target_hidden_size`` other than ``hidden_size``, a
``transformer_layer_config`` of another ``model_type`` than llama or of more than one
layer. What vLLM reads: :data:`VLLM_READS_EAGLE3`.
"""

from __future__ import annotations

import json
from pathlib import Path

from speclab.families.eagle.model import EagleMeta, EagleModel
from speclab.models.formats import eagle3_layers as e3
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

#: the fields vLLM reads of a speculators config, as dotted paths, with where (vLLM's
#: ``vllm/transformers_utils/config.py`` and ``configs/speculators/{base,algos}.py``)
VLLM_READS = {
    "speculators_config": "config.py HFConfigParser.parse: no model_type + this key "
                          "-> SpeculatorsConfig",
    "speculators_config.verifier.name_or_path": "config.py maybe_override_with_speculators "
                                                "(the target to load); base.py "
                                                "validate_speculators_config",
    "speculators_model_type": "base.py validate_speculators_config / "
                              "extract_transformers_pre_trained_config (must be a "
                              "registered algorithm) / build_vllm_speculative_config "
                              "(-> method)",
    "speculators_config.proposal_methods.0.speculative_tokens":
        "base.py validate_speculators_config / build_vllm_speculative_config "
        "(-> num_speculative_tokens) / extract_transformers_pre_trained_config "
        "(-> num_lookahead_tokens)",
    "transformer_layer_config": "base.py validate_speculators_config (a dict) / "
                                "extract_transformers_pre_trained_config (the draft's HF "
                                "config)",
    "transformer_layer_config.vocab_size": "EAGLE-1 algorithm update (truncated_vocab_size)",
    "transformer_layer_config.hidden_size": "llama_eagle.py (fc, layers)",
    "transformer_layer_config.num_hidden_layers": "llama_eagle.py (layers)",
    "transformer_layer_config.rms_norm_eps": "llama_eagle.py (norms)",
    "layernorms": "EAGLE-1 algorithm update (add_para_norm / skip_prenorm / "
                  "skip_output_norm)",
    "fusion_bias": "EAGLE-1 algorithm update (fc bias)",
}


#: the fields vLLM reads of a ``speculators_model_type: eagle3`` config, with where (vLLM's
#: ``vllm/transformers_utils/configs/speculators/{base,algos}.py`` (``update_eagle3``),
#: ``vllm/model_executor/models/llama_eagle3.py``, ``vllm/v1/worker/gpu_model_runner.py``)
VLLM_READS_EAGLE3 = {
    **{k: v for k, v in VLLM_READS.items()
       if k not in ("transformer_layer_config.vocab_size", "layernorms", "fusion_bias")},
    "speculators_model_type": "base.py extract_transformers_pre_trained_config ('eagle3' -> "
                              "algos.py update_eagle3: architectures Eagle3LlamaForCausalLM) "
                              "/ build_vllm_speculative_config (-> method eagle3)",
    "draft_vocab_size": "algos.py update_eagle3 -> llama_eagle3.py Eagle3LlamaForCausalLM "
                        "(lm_head rows, draft_id_to_target_id)",
    "norm_before_residual": "algos.py update_eagle3 (ABSENT MEANS TRUE there) -> "
                            "llama_eagle3.py LlamaDecoderLayer._residual_norm",
    "norm_before_fc": "algos.py update_eagle3 (newer vLLM; default false)",
    "target_hidden_size": "algos.py update_eagle3 (when not null) -> llama_eagle3.py "
                          "LlamaModel fc input (3 * target_hidden_size)",
    "eagle_aux_hidden_state_layer_ids": "algos.py update_eagle3 -> gpu_model_runner.py "
                                        "_get_eagle3_aux_layers_from_config (the target's "
                                        "set_aux_hidden_state_layers; absent: the target's "
                                        "get_eagle3_aux_hidden_state_layers, (2, L // 2, "
                                        "L - 3))",
    "transformer_layer_config.vocab_size": "llama_eagle3.py (embed_tokens, logits scattered "
                                           "into the target vocabulary)",
    "transformer_layer_config.hidden_size": "llama_eagle3.py (fc, the layer, norms)",
    "transformer_layer_config.num_hidden_layers": "llama_eagle3.py LlamaModel (layers; "
                                                  "layer 0 reads 2H)",
    "transformer_layer_config.num_attention_heads": "llama_eagle3.py LlamaAttention",
    "transformer_layer_config.num_key_value_heads": "llama_eagle3.py LlamaAttention",
    "transformer_layer_config.head_dim": "llama.py LlamaAttention (head_dim)",
    "transformer_layer_config.intermediate_size": "llama_eagle3.py LlamaMLP",
    "transformer_layer_config.hidden_act": "llama_eagle3.py LlamaMLP",
    "transformer_layer_config.rope_theta": "llama.py LlamaAttention (rotary embedding)",
    "transformer_layer_config.max_position_embeddings": "llama_eagle3.py LlamaAttention",
    "transformer_layer_config.attention_bias": "llama_eagle3.py (q/k/v/o bias)",
    "transformer_layer_config.mlp_bias": "llama_eagle3.py LlamaMLP (bias)",
}


def _read_layer_config(folder: Path, field: str) -> tuple[dict, Path, dict]:
    """A speculators folder's ``config.json`` (as a dict), its path, and its
    ``transformer_layer_config`` (a DrafterFormatError naming both when not a dict)."""
    where = Path(folder) / "config.json"
    cfg = read_config(Path(folder), field)
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise fail(field, where, f"transformer_layer_config={layer!r}: a LLaMA config "
                   f"dict is needed")
    return cfg, where, layer


def read_speculators(folder: Path, target: TargetParts | None, field: str,
                     advice: str = "", target_config=None) -> EagleModel:
    """The ``speculators_model_type: eagle`` drafter in ``folder`` as an EagleModel, its
    shapes checked against ``target.config`` or ``target_config`` when given, embedding
    and LM head taken from ``target`` (``fusion_fc.weight [H, 2H]`` becomes ``fc``,
    ``transformer.*`` layer 0); errors name the file and the field."""
    folder = Path(folder)
    cfg, where, layer = _read_layer_config(folder, field)
    arch = cfg.get("transformer_layer_architecture", "LlamaDecoderLayer")
    kind = layer.get("model_type", "llama")
    if arch not in ("LlamaDecoderLayer", "auto") or kind != "llama":
        raise fail(field, where, f"transformer_layer_architecture={arch!r} with "
                   f"transformer_layer_config.model_type={kind!r}: speclab's drafter "
                   f"layer is LLaMA's (LlamaDecoderLayer)")
    if cfg.get("layernorms"):
        raise fail(field, where, "layernorms=true: that variant normalises the token "
                   "embedding (embedding_layernorm), which speclab's drafter does not have")
    layers = layer.get("num_hidden_layers", 1)
    if layers != 1:
        raise fail(field, where, f"transformer_layer_config.num_hidden_layers={layers!r}: "
                   f"speculators' eagle drafter has one transformer layer")
    fields = llama_fields(layer, where, field, "transformer_layer_config.")
    weights = weight_file(folder)
    if weights is None:
        raise fail(field, folder, "has no model.safetensors / pytorch_model.bin")
    raw = read_tensors(weights, field)
    tensors = {}
    for name, t in raw.items():
        if name.startswith("fusion_fc."):
            name = "fc." + name.removeprefix("fusion_fc.")
        elif name.startswith("transformer."):
            name = "layers.0." + name.removeprefix("transformer.")
        elif name.startswith(("embedding_layernorm.", "pre_lm_head_layernorm.")):
            raise fail(field, weights, f"holds {name}, but config.json has layernorms=false")
        tensors[name] = t
    bias = "fc.bias" in tensors
    if bool(cfg.get("fusion_bias", False)) != bias:
        raise fail(field, where, f"fusion_bias={cfg.get('fusion_bias', False)!r}, but "
                   f"{weights.name} {'holds' if bias else 'has no'} fusion_fc.bias")
    verifier = (cfg.get("speculators_config") or {}).get("verifier") or {}
    archs = verifier.get("architectures") or [""]
    meta = EagleMeta(target_architecture=str(archs[0]), layers=1, input_norm=False,
                     final_norm=False, fc_bias=bias, **fields)
    config = target.config if target is not None else target_config
    if config is not None:  # before the LM head is looked for: the shapes come first
        check_target_shape(meta, config, where, field,
                           ("transformer_layer_config.hidden_size",
                            "transformer_layer_config.vocab_size"))
    return assemble(meta, tensors, weights, field, target, advice)


def speculators_problem(meta: EagleMeta) -> str | None:
    """Why a drafter with ``meta`` cannot be written in the speculators eagle format
    exactly (None: it can)."""
    if meta.input_norm or meta.final_norm:
        which = " and ".join(n for n, on in (("an input norm in layer 0", meta.input_norm),
                                            ("a final norm", meta.final_norm)) if on)
        return (f"the drafter has {which} (speclab's layout: config.json input_norm="
                f"{meta.input_norm}, final_norm={meta.final_norm}); speculators' eagle "
                f"format has one switch for norms, layernorms: false drops both, and true "
                f"adds a third on the token embedding (embedding_layernorm) that this "
                f"drafter does not have, so neither computes what the drafter computes; "
                f"train the drafter with eagle.norms: false to export it here")
    if meta.layers != 1:
        return (f"the drafter has {meta.layers} decoder layers; speculators' eagle drafter "
                f"has one (transformer)")
    if meta.embed_scale != 1.0:
        return (f"the drafter scales the token embedding by {meta.embed_scale:g} "
                f"(embed_scale); the format has no field for it")
    return None


def _speculators_config(algorithm: str, speculative_tokens: int, verifier: str | None,
                        verifier_arch: str, field: str) -> dict:
    """The ``speculators_config`` block of an exported config: one greedy proposal method
    of ``speculative_tokens`` tokens and the verifier (the target) vLLM loads; a
    DrafterFormatError without a verifier (naming ``field``) or tokens."""
    if not verifier:
        raise DrafterFormatError(f"{field}: speculators_config.verifier.name_or_path (the "
                                 f"target vLLM loads) is unknown: name the target "
                                 f"(--target)")
    if speculative_tokens < 1:
        raise DrafterFormatError(f"speculative_tokens: must be >= 1, got {speculative_tokens}")
    return {"algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": int(speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(verifier),
                         "architectures": [verifier_arch] if verifier_arch else []}}


def write_speculators(model: EagleModel, out: Path, verifier: str | None,
                      verifier_arch: str = "", speculative_tokens: int = 5,
                      field: str = "--format speculators") -> Path:
    """Write ``model`` in the speculators eagle format (``config.json`` as in the module
    docstring, ``model.safetensors`` without embedding and LM head). ``verifier``: the
    target's name or path vLLM loads (``speculators_config.verifier.name_or_path``);
    ``speculative_tokens``: vLLM's default ``num_speculative_tokens``. A drafter the
    format cannot hold exactly, or no verifier, is a DrafterFormatError naming why."""
    from safetensors.torch import save_file

    problem = speculators_problem(model.meta)
    if problem:
        raise DrafterFormatError(f"{field}: cannot write this drafter in the speculators "
                                 f"eagle format: {problem}")
    meta = model.meta
    cfg = {
        "architectures": ["EagleSpeculator", "LlamaDecoderLayer"],
        "speculators_model_type": "eagle",
        "transformer_layer_architecture": "LlamaDecoderLayer",
        "transformer_layer_config": llama_config_dict(meta, 1),
        "layernorms": False,
        "fusion_bias": meta.fc_bias,
        "torch_dtype": "float32",
        "speculators_config": _speculators_config("eagle", speculative_tokens, verifier,
                                                  verifier_arch, field),
    }
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    state = {}
    for name, t in public_tensors(model, embedding=False).items():
        if name.startswith("fc."):
            name = "fusion_fc." + name.removeprefix("fc.")
        elif name.startswith("layers.0."):
            name = "transformer." + name.removeprefix("layers.0.")
        state[name] = t.float().contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def read_speculators_eagle3(folder: Path, target: TargetParts | None, field: str,
                            advice: str = "", target_config=None):
    """The ``speculators_model_type: eagle3`` drafter in ``folder`` (module docstring) as
    an :class:`~speclab.families.eagle.model3.Eagle3Model`, its shapes checked against
    ``target.config`` or ``target_config`` when given, its target layers the config's
    ``eagle_aux_hidden_state_layer_ids`` or EAGLE-3's default for the target; errors name
    the file and the field."""
    folder = Path(folder)
    cfg, where, layer = _read_layer_config(folder, field)
    kind = layer.get("model_type", "llama")
    if kind != "llama":
        raise fail(field, where, f"transformer_layer_config.model_type={kind!r}: speclab's "
                   f"EAGLE-3 layer is LLaMA's (qwen3's adds q/k norms)")
    layers = layer.get("num_hidden_layers", 1)
    if layers != 1:
        raise fail(field, where, f"transformer_layer_config.num_hidden_layers={layers!r}: "
                   f"speclab's EAGLE-3 drafter has one decoder layer")
    if "norm_before_residual" not in cfg:
        raise fail(field, where, "has no norm_before_residual: speculators reads that as "
                   "false and vLLM as true, so what the drafter computes is unknown")
    fields = llama_fields(layer, where, field, "transformer_layer_config.")
    e3.reject_variants(cfg, fields["hidden_size"], where, field)
    named = e3.named_layers(cfg, where, field, sglang=False)
    weights = weight_file(folder)
    if weights is None:
        raise fail(field, folder, "has no model.safetensors / pytorch_model.bin")
    tensors = read_tensors(weights, field)
    if "input_norm.weight" in tensors:
        raise fail(field, weights, "holds input_norm.weight (norm_before_fc's RMS norm over "
                   "the fused target states), which speclab's drafter does not have")
    verifier = (cfg.get("speculators_config") or {}).get("verifier") or {}
    arch = str((verifier.get("architectures") or [""])[0])
    return e3.build(cfg, fields, named, tensors, e3.SPECULATORS_PREFIX, arch, where, weights,
                    field, target, target_config, advice, "transformer_layer_config.")


def speculators_eagle3_problem(meta: EagleMeta, num_layers: int | None = None) -> str | None:
    """Why an EAGLE-3 drafter with ``meta`` cannot be written in the speculators eagle3
    format exactly (None: it can); ``num_layers``: the target's depth when known."""
    return e3.public_problem(meta, "speculators' eagle3", num_layers)


def write_speculators_eagle3(model, out: Path, verifier: str | None, verifier_arch: str = "",
                             speculative_tokens: int = 5, field: str = "--format speculators",
                             num_layers: int | None = None) -> Path:
    """Write the EAGLE-3 drafter ``model`` in the speculators eagle3 format
    (``config.json`` as in the module docstring, ``model.safetensors`` with every tensor,
    the embedding included). ``verifier`` / ``speculative_tokens`` as in
    :func:`write_speculators`; a drafter the format cannot hold exactly, or no verifier,
    is a DrafterFormatError naming why."""
    from safetensors.torch import save_file

    problem = speculators_eagle3_problem(model.meta, num_layers)
    if problem:
        raise DrafterFormatError(f"{field}: cannot write this drafter in the speculators "
                                 f"eagle3 format: {problem}")
    meta = model.meta
    ids = e3.meta_fields(meta)
    cfg = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": llama_config_dict(meta, 1),
        "draft_vocab_size": ids["draft_vocab_size"],
        "norm_before_residual": False,
        "norm_before_fc": False,
        "target_hidden_size": meta.hidden_size,
        e3.VLLM_IDS: ids[e3.VLLM_IDS],
        "embed_requires_grad": False,
        "torch_dtype": "float32",
        "speculators_config": _speculators_config("eagle3", speculative_tokens, verifier,
                                                  verifier_arch, field),
    }
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(e3.public_tensors(model, e3.SPECULATORS_PREFIX), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out

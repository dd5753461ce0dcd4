"""The speculators format (vllm-project/speculators): a drafter folder whose
``config.json`` has ``speculators_model_type`` and a ``speculators_config`` naming the
verifier (the target).

``speculators_model_type: eagle3`` (speculators' ``Eagle3SpeculatorConfig`` /
``Eagle3DraftModel``, vLLM's ``Eagle3LlamaForCausalLM``), read and written::

    {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
     "transformer_layer_config": {<the LLaMA config of the drafter's layer; vocab_size is
         the TARGET's vocabulary; attention_bias: q/k/v/o biases (written; on reading,
         the bias tensors the file holds decide)>},
     "draft_vocab_size": V_d, "norm_before_residual": false, "norm_before_fc": false,
     "fc_norm": false, "norm_output": false, "target_hidden_size": H_t,
     "eagle_aux_hidden_state_layer_ids": [a, b, c],
     "speculators_config": {"algorithm": "eagle3",
         "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": N,
                               "verifier_accept_k": 1, "accept_tolerance": 0.0}],
         "default_proposal_method": "greedy",
         "verifier": {"name_or_path": TARGET, "architectures": [TARGET_ARCH]}}}

No top-level ``model_type``: vLLM picks its speculators config class from the presence of
``speculators_config`` when ``model_type`` is absent.

``model.safetensors``: ``fc.weight [H, 3H_t]`` (old speculators: also ``fc.bias``),
``layers.0.{self_attn,mlp}.*``, ``layers.0.{hidden_norm,input_layernorm,
post_attention_layernorm}.weight``, ``norm.weight``, ``lm_head.weight [V_d, H]``,
``d2t [V_d]`` and ``t2d [V]`` (absent for a full vocabulary: speculators registers them as
None), ``input_norm.weight`` (``norm_before_fc``), ``fc_norm.{i}.weight``
(``fc_norm``), optionally ``embed_tokens.weight`` (absent: the verifier's; speclab always
writes it, so the export is the drafter exactly). The mapping and the variants
(``norm_before_residual``, ``norm_before_fc``, ``fc_norm``, ``norm_output``: the normed
state fed back, ``target_hidden_size``) are :mod:`.eagle3_layers`'. Written: every
variant but ``target_hidden_size != hidden_size`` (speculators 0.9.0 builds ``fc`` with
``num_aux * hidden_size`` inputs and refuses such a file), SpecForge's ``norm_output:
false`` and attention biases other than all four or none. Refused on reading by name: an
absent ``norm_before_residual`` (speculators reads false, vLLM true), a
``transformer_layer_config`` of another ``model_type`` than llama or of more than one
layer (speculators' multi-layer drafter). What released vLLM reads:
:data:`VLLM_READS_EAGLE3`.

``speculators_model_type: eagle`` (the EAGLE-1/2 / HASS drafter of speculators before it
dropped the algorithm; 0.9.0 registers dflash, dflash2, dspark, eagle3, mtp, peagle and
xpress, and vLLM never registered ``eagle``) is READ, never written: ``config.json``
``transformer_layer_config`` (LLaMA, one layer), ``layernorms: false``, ``fusion_bias``;
``model.safetensors`` ``fusion_fc.weight [H, 2H]`` over ``concat(Embed, f)``,
``fusion_fc.bias`` (with ``fusion_bias``), ``transformer.<LLaMA decoder layer tensors>``
(its ``input_layernorm`` an identity); embedding and LM head are the verifier's.
``layernorms: true`` (a norm on the token embedding) is refused. An EAGLE-1/2 drafter
exports to the EAGLE research layout (``--format eagle``), which the EAGLE code and
SGLang read.
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
)
from speclab.models.formats.files import (
    DrafterFormatError,
    TargetParts,
    fail,
    read_config,
    read_tensors,
    weight_file,
)

#: the fields released vLLM (0.33) reads of every speculators config, as dotted paths,
#: with where (``vllm/transformers_utils/config.py`` and
#: ``vllm/transformers_utils/configs/speculators/base.py``)
VLLM_READS = {
    "speculators_config": "config.py: no model_type + this key -> SpeculatorsConfig; "
                          "maybe_override_with_speculators",
    "speculators_config.verifier.name_or_path": "config.py maybe_override_with_speculators "
                                                "(the target to load: a hub id, a local "
                                                "path is refused) / base.py "
                                                "validate_speculators_config",
    "speculators_model_type": "base.py extract_transformers_pre_trained_config (a "
                              "registered algorithm: eagle3, peagle, dflash, dflash2, "
                              "dspark) / build_vllm_speculative_config (-> method)",
    "speculators_config.proposal_methods.0.speculative_tokens":
        "base.py validate_speculators_config / build_vllm_speculative_config "
        "(-> num_speculative_tokens)",
    "transformer_layer_config": "base.py validate_speculators_config (a dict) / "
                                "extract_transformers_pre_trained_config (the draft's HF "
                                "config)",
}


#: the fields released vLLM (0.33) reads of a ``speculators_model_type: eagle3`` config,
#: with where (``configs/speculators/algos.py`` ``update_eagle3``,
#: ``vllm/model_executor/models/llama_eagle3.py``,
#: ``vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py``)
VLLM_READS_EAGLE3 = {
    **VLLM_READS,
    "draft_vocab_size": "algos.py update_eagle3 -> llama_eagle3.py Eagle3LlamaForCausalLM "
                        "(lm_head rows; draft_id_to_target_id unless the full vocabulary)",
    "norm_before_residual": "algos.py update_eagle3 (ABSENT MEANS TRUE there) -> "
                            "llama_eagle3.py LlamaDecoderLayer._residual_norm",
    "norm_before_fc": "algos.py update_eagle3 -> llama_eagle3.py input_norm",
    "fc_norm": "algos.py update_eagle3 -> llama_eagle3.py fc_norm (one norm per state)",
    "norm_output": "algos.py update_eagle3 -> llama_eagle3.py LlamaModel.forward (the "
                   "post-norm state fed back)",
    "target_hidden_size": "algos.py update_eagle3 (when not null) -> llama_eagle3.py "
                          "LlamaModel fc input (k * target_hidden_size)",
    "eagle_aux_hidden_state_layer_ids": "algos.py update_eagle3 -> eagle3_utils.py "
                                        "get_eagle3_aux_layers_from_config (absent: the "
                                        "target's default, (2, L // 2, L - 3))",
    "transformer_layer_config.model_type": "algos.py update_eagle3 (llama -> "
                                           "Eagle3LlamaForCausalLM, qwen3 -> "
                                           "Eagle3Qwen3ForCausalLM)",
    "transformer_layer_config.vocab_size": "llama_eagle3.py (embed_tokens, logits scattered "
                                           "into the target vocabulary)",
    "transformer_layer_config.hidden_size": "llama_eagle3.py (fc, the layer, norms)",
    "transformer_layer_config.num_hidden_layers": "llama_eagle3.py LlamaModel (layers; "
                                                  "layer 0 reads 2H)",
    "transformer_layer_config.num_attention_heads": "llama.py LlamaAttention",
    "transformer_layer_config.num_key_value_heads": "llama.py LlamaAttention",
    "transformer_layer_config.head_dim": "llama.py LlamaAttention (head_dim)",
    "transformer_layer_config.intermediate_size": "llama.py LlamaMLP",
    "transformer_layer_config.hidden_act": "llama.py LlamaMLP",
    "transformer_layer_config.rms_norm_eps": "llama_eagle3.py (norms)",
    "transformer_layer_config.rope_theta": "llama.py LlamaAttention (rotary embedding)",
    "transformer_layer_config.max_position_embeddings": "llama.py LlamaAttention; the "
                                                        "draft's max_model_len",
    "transformer_layer_config.attention_bias": "llama_eagle3.py (q/k/v bias) / llama.py "
                                               "(o_proj bias)",
    "transformer_layer_config.mlp_bias": "llama.py LlamaMLP (bias)",
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
    """Why an EAGLE-1/2 drafter with ``meta`` cannot be written in the speculators format:
    always (module docstring: no runtime reads ``speculators_model_type: eagle``)."""
    del meta
    return ("speculators removed its EAGLE-1/2 algorithm (speculators_model_type: eagle; "
            "0.9.0 reads dflash, dflash2, dspark, eagle3, mtp, peagle, xpress) and vLLM "
            "never registered it, so no runtime reads that export; write the EAGLE research "
            "layout instead (--format eagle), which the EAGLE code and SGLang read")


def verifier_config(verifier: str | None) -> dict | None:
    """The target's HF ``config.json`` (its ``text_config`` for a multimodal one) when
    ``verifier`` is a local folder holding one, else None (nothing is downloaded)."""
    import json as _json

    path = Path(str(verifier)) / "config.json" if verifier else None
    if path is None or not path.is_file():
        return None
    try:
        cfg = _json.loads(path.read_text())
    except ValueError:
        return None
    inner = cfg.get("text_config")
    return {**inner, "architectures": cfg.get("architectures")} \
        if isinstance(inner, dict) and "hidden_size" not in cfg else cfg


def _speculators_config(algorithm: str, speculative_tokens: int, verifier: str | None,
                        verifier_arch: str, field: str) -> dict:
    """The ``speculators_config`` block of an exported config: one greedy proposal method
    of ``speculative_tokens`` tokens and the verifier (the target) vLLM loads, its
    architecture ``verifier_arch`` or, when empty, the one of the target's local
    ``config.json``; a DrafterFormatError (naming ``field`` and ``--target``) without a
    verifier, its architecture, or tokens."""
    if not verifier:
        raise DrafterFormatError(f"{field}: speculators_config.verifier.name_or_path (the "
                                 f"target vLLM loads) is unknown: name the target "
                                 f"(--target)")
    if speculative_tokens < 1:
        raise DrafterFormatError(f"speculative_tokens: must be >= 1, got {speculative_tokens}")
    if not verifier_arch:
        archs = (verifier_config(verifier) or {}).get("architectures") or []
        verifier_arch = str(archs[0]) if archs else ""
    if not verifier_arch:
        raise DrafterFormatError(f"{field}: speculators_config.verifier.architectures (the "
                                 f"target's architecture, which speculators checks) is "
                                 f"unknown: the drafter does not record it and {verifier!r} "
                                 f"is no local folder with a config.json; give --target as "
                                 f"the target's local folder")
    return {"algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": int(speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(verifier), "architectures": [verifier_arch]}}


#: rope_scaling types whose computation does not read max_position_embeddings (plain RoPE
#: is None): raising the field to the target's changes nothing the drafter computes
_ROPE_WITHOUT_MAX = (None, "default", "linear", "llama3")


def _max_positions(meta: EagleMeta, verifier: str | None) -> int:
    """``max_position_embeddings`` of an export: max(drafter, target) as speculators'
    converter writes it (vLLM caps the draft's context there), when the target's config is
    local and the drafter's RoPE does not read the field; else the drafter's."""
    target = (verifier_config(verifier) or {}).get("max_position_embeddings")
    rope = meta.rope_scaling or {}
    kind = rope.get("rope_type", rope.get("type")) if rope else None
    if isinstance(target, int) and kind in _ROPE_WITHOUT_MAX:
        return max(meta.max_positions, target)
    return meta.max_positions


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
                   f"a multi-layer EAGLE-3 drafter (speculators stacks plain decoder layers "
                   f"after the first), which speclab's (one decoder layer) does not compute")
    if "norm_before_residual" not in cfg:
        raise fail(field, where, "has no norm_before_residual: speculators reads that as "
                   "false and vLLM as true, so what the drafter computes is unknown")
    fields = llama_fields(layer, where, field, "transformer_layer_config.",
                          bias_from_tensors=True)
    variant = e3.variant_fields(cfg, fields["hidden_size"], where, field, research=False)
    named = e3.named_layers(cfg, where, field, sglang=False)
    weights = weight_file(folder)
    if weights is None:
        raise fail(field, folder, "has no model.safetensors / pytorch_model.bin")
    tensors = read_tensors(weights, field)
    verifier = (cfg.get("speculators_config") or {}).get("verifier") or {}
    arch = str((verifier.get("architectures") or [""])[0])
    return e3.build(cfg, fields, named, tensors, e3.SPECULATORS_PREFIX, arch, where, weights,
                    field, target, target_config, advice, "transformer_layer_config.",
                    variant)


def speculators_eagle3_problem(meta: EagleMeta, num_layers: int | None = None) -> str | None:
    """Why an EAGLE-3 drafter with ``meta`` cannot be written in the speculators eagle3
    format exactly (None: it can); ``num_layers``: the target's depth when known."""
    return e3.public_problem(meta, "speculators' eagle3", num_layers)


def write_speculators_eagle3(model, out: Path, verifier: str | None, verifier_arch: str = "",
                             speculative_tokens: int = 5, field: str = "--format speculators",
                             num_layers: int | None = None) -> Path:
    """Write the EAGLE-3 drafter ``model`` in the speculators eagle3 format
    (``config.json`` as in the module docstring, ``model.safetensors`` with every tensor,
    the embedding included, ``d2t`` / ``t2d`` only for a reduced vocabulary).
    ``verifier``: the target's name or folder vLLM loads (its local ``config.json``, when
    there, gives the verifier's architecture when ``verifier_arch`` is empty and raises
    ``max_position_embeddings`` to the target's, as speculators' converter does);
    ``speculative_tokens``: vLLM's default ``num_speculative_tokens``. A drafter the format
    cannot hold exactly, or no verifier or architecture, is a DrafterFormatError naming
    why."""
    from safetensors.torch import save_file

    problem = speculators_eagle3_problem(model.meta, num_layers)
    if problem:
        raise DrafterFormatError(f"{field}: cannot write this drafter in the speculators "
                                 f"eagle3 format: {problem}")
    meta = model.meta
    ids = e3.meta_fields(meta)
    speculators_config = _speculators_config("eagle3", speculative_tokens, verifier,
                                             verifier_arch, field)
    layer = llama_config_dict(meta, 1)
    layer["max_position_embeddings"] = _max_positions(meta, verifier)
    cfg = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": ids["draft_vocab_size"],
        "norm_before_residual": meta.residual_norm,
        "norm_before_fc": meta.fc_input_norm,
        "fc_norm": meta.fc_state_norms,
        "norm_output": meta.feed_normed,
        "target_hidden_size": meta.target_hidden_size or meta.hidden_size,
        e3.VLLM_IDS: ids[e3.VLLM_IDS],
        "embed_requires_grad": False,
        "torch_dtype": "float32",
        "speculators_config": speculators_config,
    }
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(e3.public_tensors(model, e3.SPECULATORS_PREFIX, vocab_maps=False),
              str(out / "model.safetensors"), metadata={"format": "pt"})
    return out

"""A draft model cut from a larger model of the same tokenizer: its token embeddings, its
first ``layers`` decoder layers, its final norm and its LM head, in its own architecture.

Distilling such a draft (``arch.init_from`` in a distillation job) starts from the
target's own vocabulary geometry instead of random weights: a randomly initialised
draft of a 49,152-token vocabulary spends most of a CPU-sized training budget learning
its embeddings (SmolLM2-135M-Instruct: the tied embedding/LM head is 28M of the
model's 135M parameters). The cost ratio c of the cut model is roughly
``(layers * per-layer weights + LM head) / (all layers + LM head)`` at batch 1.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel


def _layer_list(model: PreTrainedModel) -> torch.nn.ModuleList | None:
    """The decoder-layer list of a decoder-only model (``model.model.layers`` in the
    LLaMA-style families), None when it has none under that name."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return layers if isinstance(layers, torch.nn.ModuleList) else None


def check_cut(source: str, layers: int, vocab: int, field: str = "arch.init_from") -> None:
    """Refuse a cut that cannot work, from ``source``'s config alone (no weights read):
    ``layers`` above the source's decoder layers, or a vocabulary of another size than
    ``vocab`` (the target's). Errors name ``field``."""
    cfg = AutoConfig.from_pretrained(source, trust_remote_code=False)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    total = getattr(text, "num_hidden_layers", None)
    if total is None:
        raise ValueError(f"{field}: {source} ({cfg.model_type}) has no num_hidden_layers "
                         "to cut")
    if layers > total:
        raise ValueError(f"arch.layers: {layers} exceeds the {total} decoder layers of "
                         f"{field} {source}")
    if int(text.vocab_size) != int(vocab):
        raise ValueError(f"{field}: {source} has a vocabulary of {text.vocab_size} tokens, "
                         f"the target {vocab}")


def _cut_config(cfg: PretrainedConfig, layers: int) -> None:
    """``cfg`` with ``layers`` decoder layers (per-layer lists such as ``layer_types``
    cut to match)."""
    cfg.num_hidden_layers = layers
    for name in ("layer_types", "sliding_window_pattern_list"):
        value = getattr(cfg, name, None)
        if isinstance(value, list):
            setattr(cfg, name, value[:layers])


def cut_model(source: str, layers: int, vocab: int, eos: int | None = None,
              field: str = "arch.init_from") -> PreTrainedModel:
    """``source`` (a model folder) in float32, cut to its first ``layers`` decoder layers:
    embeddings ``[V, d]``, layers ``0..layers-1``, final norm and LM head ``[V, d]`` (tied
    where the source ties them) keep the source's weights. ``vocab``: the target's
    vocabulary size (checked, :func:`check_cut`); ``eos``: the generation config's
    end-of-sequence id when given. Errors name ``field``; a model without a decoder-layer
    list under ``model.layers`` is refused by its class name."""
    check_cut(source, layers, vocab, field)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32,
                                                 trust_remote_code=False)
    stack = _layer_list(model)
    if stack is None:
        raise ValueError(f"{field}: {source} is a {type(model).__name__}, which has no "
                         "model.layers list to cut")
    model.model.layers = torch.nn.ModuleList(list(stack)[:layers])
    _cut_config(model.config, layers)
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
        else model.config
    if text is not model.config:
        _cut_config(text, layers)
    if eos is not None:
        model.generation_config.eos_token_id = eos
    return model

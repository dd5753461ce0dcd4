"""Load target / draft causal LMs and tokenizers from a local folder or a hub id.

A local folder (written by ``save_pretrained``) is used when it exists; anything else
that looks like ``org/name`` is passed to the Hugging Face hub loader; MLflow registry
URIs (``models:/name/version``, ``runs:/id/model``) are downloaded through
:func:`speclab.tracking_store.resolve_model_uri` (MLflow is imported only then).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from speclab.decoding.attention import UnsupportedModel, attention_layout
from speclab.models.gguf import gguf_folder, is_gguf
from speclab.models.real import ensure_real_model, real_model
from speclab.tracking_store import resolve_model_uri

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: attention implementations a model may be loaded with: ``auto`` is sdpa where the model
#: supports it, else eager (Gemma-2: its logit soft-capping has no sdpa kernel);
#: flex_attention is left out (with the engine's 4D masks it crashed on CPU)
ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "eager")


class ModelLoadError(ValueError):
    """A model or tokenizer could not be found or does not fit its partner."""


def resolve_device(device: str) -> torch.device:
    """``"auto"`` -> CUDA when present else CPU; anything else is used as given."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ModelLoadError(f"device: must be cpu, cuda, cuda:N or auto, got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device: {device!r} requested but CUDA is not available")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise ModelLoadError(f"device: {device!r} requested but this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s)")
    if dev.type not in ("cpu", "cuda"):
        raise ModelLoadError(f"device: must be cpu, cuda, cuda:N or auto, got {device!r}")
    return dev


def resolve_source(source: str, field: str = "model") -> str:
    """A local folder (MLflow URIs downloaded) or a hub id; errors name ``field``."""
    return _check_source(source, field)


def registry_or_folder(source: str, field: str) -> str:
    """A drafter folder (EAGLE drafter, Medusa heads): ``models:/`` URIs are downloaded,
    local folders are used as given (their own loader checks what they hold)."""
    return resolve_source(source, field) if source.startswith("models:/") else source


#: ``models:/<name>/<version|stage|latest>``, ``models:/<name>@<alias>``,
#: ``runs:/<run id>/<artifact path>``: names never hold ``..`` or empty path parts
_NAME = r"[A-Za-z0-9][A-Za-z0-9_.\- ]{0,255}"
_URI_SHAPES = (re.compile(rf"models:/{_NAME}/[A-Za-z0-9_.\-]{{1,64}}"),
               re.compile(rf"models:/{_NAME}@[A-Za-z0-9_\-]{{1,64}}"),
               re.compile(r"runs:/[0-9a-f]{32}(/[A-Za-z0-9_.\-]{1,255})+"))


def check_registry_uri(source: str, field: str = "model") -> str:
    """``source`` if it is a well-formed MLflow model URI whose parts cannot name another
    directory (no ``..``, no empty parts, no absolute paths); ModelLoadError otherwise."""
    parts = source.split(":/", 1)[1].replace("@", "/").split("/")
    if (not any(p.fullmatch(source) for p in _URI_SHAPES)
            or any(part in ("", ".", "..") or part.startswith(".") for part in parts)):
        raise ModelLoadError(
            f"{field}: {source!r} is not a model URI (models:/NAME/VERSION, models:/NAME@ALIAS "
            "or runs:/RUN_ID/PATH; names may not contain '..' or empty parts)")
    return source


def _check_source(source: str, field: str) -> str:
    if real_model(source) is not None:  # smollm2-135m: the cached folder, built once
        return str(ensure_real_model(source))
    if is_gguf(source):  # a GGUF file: its converted folder, cached by checksum
        return str(gguf_folder(source, field))
    if source.startswith(("models:/", "runs:/")):  # MLflow registry: download, then a folder

        return resolve_model_uri(check_registry_uri(source, field))
    path = Path(source).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelLoadError(
                f"{field}: {source!r} has no config.json (not a saved model folder)"
            )
        return str(path)
    looks_like_path = source.startswith((".", "/", "~")) or source.count("/") != 1
    if looks_like_path:
        raise ModelLoadError(f"{field}: model directory {source!r} does not exist")
    return source  # a hub id such as "org/name"


def load_model(
    source: str, dtype: str = "float32", device: str = "cpu", field: str = "model",
    attn_implementation: str = "auto",
) -> PreTrainedModel:
    """Load a causal LM in eval mode.

    Args:
        source: local folder or hub id.
        dtype: one of ``float32``, ``float16``, ``bfloat16``.
        device: ``cpu``, ``cuda[:i]`` or ``auto``.
        field: name used in error messages (``target`` / ``draft``).
        attn_implementation: ``auto`` (sdpa where the model supports it, else eager),
            ``sdpa`` or ``eager`` (:data:`ATTN_IMPLEMENTATIONS`).
    Raises:
        ModelLoadError naming ``field`` for a model the engine cannot decode correctly
        (:func:`speclab.decoding.attention.attention_layout`) or cannot load.
    """
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype: must be one of {sorted(DTYPES)}, got {dtype!r}")
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ModelLoadError(f"attn_implementation: must be one of "
                             f"{list(ATTN_IMPLEMENTATIONS)}, got {attn_implementation!r}")
    src = _check_source(source, field)
    impl = "sdpa" if attn_implementation == "auto" else attn_implementation
    try:  # code shipped with a model (config auto_map) is never run
        model = _from_pretrained(src, dtype, impl)
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise ModelLoadError(
                f"{field}: {source!r} needs custom code shipped with the model; speclab "
                "never runs it (trust_remote_code is always off)") from None
        if attn_implementation != "auto" or "attention implementation" not in str(exc):
            raise ModelLoadError(f"{field}: {source!r}: {exc}") from None
        model = _from_pretrained(src, dtype, "eager")  # the model has no sdpa path

    try:
        attention_layout(model.config)
    except UnsupportedModel as exc:
        raise ModelLoadError(f"{field}: {exc}") from None
    return model.to(resolve_device(device)).eval()


def _from_pretrained(src: str, dtype: str, impl: str) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(
        src, dtype=DTYPES[dtype], attn_implementation=impl, trust_remote_code=False)


def load_tokenizer(source: str, field: str = "tokenizer"):
    """Load the tokenizer saved next to a model (or from the hub); ``None`` if absent."""
    src = _check_source(source, field)
    try:
        return AutoTokenizer.from_pretrained(src, trust_remote_code=False)
    except (OSError, ValueError):
        return None


#: config attributes that hold a model's context length, by family
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length",
                "seq_length")


def context_length(config) -> int | None:
    """The positions a model with this (transformers) ``config`` attends over: its
    ``max_position_embeddings`` or a family's other name for it; None when the config
    names none (a model without a position limit)."""
    for key in CONTEXT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_same_vocab(target: PreTrainedModel, draft: PreTrainedModel) -> None:
    """Target and draft must index the same vocabulary."""
    vt, vd = int(target.config.vocab_size), int(draft.config.vocab_size)
    if vt != vd:
        raise ModelLoadError(
            f"vocab mismatch: target vocab_size={vt} but draft vocab_size={vd}; "
            "target and draft must share one tokenizer"
        )

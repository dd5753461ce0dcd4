"""Load target / draft causal LMs and tokenizers from a local folder or a hub id.

A local folder (written by ``save_pretrained``) is used when it exists; anything else
that looks like ``org/name`` is passed to the Hugging Face hub loader; MLflow registry
URIs (``models:/name/version``, ``runs:/id/model``) are downloaded through
:func:`speclab.tracking.resolve_model_uri` (MLflow is imported only then).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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


def _check_source(source: str, field: str) -> str:
    if source.startswith(("models:/", "runs:/")):  # MLflow registry: download, then a folder
        from speclab.tracking import resolve_model_uri

        return resolve_model_uri(source)
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
    source: str, dtype: str = "float32", device: str = "cpu", field: str = "model"
) -> PreTrainedModel:
    """Load a causal LM in eval mode with sdpa attention.

    Args:
        source: local folder or hub id.
        dtype: one of ``float32``, ``float16``, ``bfloat16``.
        device: ``cpu``, ``cuda[:i]`` or ``auto``.
        field: name used in error messages (``target`` / ``draft``).
    """
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype: must be one of {sorted(DTYPES)}, got {dtype!r}")
    src = _check_source(source, field)
    model = AutoModelForCausalLM.from_pretrained(
        src, dtype=DTYPES[dtype], attn_implementation="sdpa"
    )
    return model.to(resolve_device(device)).eval()


def load_tokenizer(source: str, field: str = "tokenizer"):
    """Load the tokenizer saved next to a model (or from the hub); ``None`` if absent."""
    src = _check_source(source, field)
    try:
        return AutoTokenizer.from_pretrained(src)
    except (OSError, ValueError):
        return None


def check_same_vocab(target: PreTrainedModel, draft: PreTrainedModel) -> None:
    """Target and draft must index the same vocabulary."""
    vt, vd = int(target.config.vocab_size), int(draft.config.vocab_size)
    if vt != vd:
        raise ModelLoadError(
            f"vocab mismatch: target vocab_size={vt} but draft vocab_size={vd}; "
            "target and draft must share one tokenizer"
        )

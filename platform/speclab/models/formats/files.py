"""Reading a drafter checkpoint's files: its ``config.json``, its tensors (one file or a
sharded index, safetensors or ``torch.save`` pickles read with ``weights_only``) and the
target's embedding and LM head that public EAGLE checkpoints leave out.

Every error is a :class:`DrafterFormatError` (a ValueError) that starts with the field
that named the drafter (``eagle_model``, ``medusa_model``, ``SOURCE``) and names the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn


class DrafterFormatError(ValueError):
    """A drafter folder that is no known format, or does not fit its target."""


def fail(field: str, where: Path | str, what: str) -> DrafterFormatError:
    """The error ``"<field>: <where>: <what>"`` (``where``: the file)."""
    return DrafterFormatError(f"{field}: {where}: {what}")


def read_config(folder: Path, field: str) -> dict:
    """``folder/config.json`` as a dict (an error naming the file when it is missing or
    not a JSON object)."""
    path = Path(folder) / "config.json"
    if not Path(folder).is_dir():
        raise DrafterFormatError(f"{field}: drafter folder {folder} does not exist")
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise fail(field, path, "missing (every drafter format has a config.json)") from None
    except ValueError as e:
        raise fail(field, path, f"not JSON ({e})") from None
    if not isinstance(data, dict):
        raise fail(field, path, f"holds a {type(data).__name__}, not a JSON object")
    return data


#: single-file weight names, in the order they are looked for
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def weight_file(folder: Path, names: tuple[str, ...] = WEIGHT_FILES + INDEX_FILES) -> Path | None:
    """The first of ``names`` present in ``folder`` (None: none is)."""
    for name in names:
        if (Path(folder) / name).exists():
            return Path(folder) / name
    return None


def _load_one(path: Path, field: str, names: set[str] | None = None
              ) -> dict[str, torch.Tensor]:
    """The tensors of one weights file (``names``: only those: safetensors read by name, a
    ``torch.save`` pickle memory-mapped where it can be)."""
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open
            from safetensors.torch import load_file

            if names is None:
                return load_file(str(path))
            with safe_open(str(path), "pt") as f:
                return {n: f.get_tensor(n) for n in names if n in f.keys()}
        state = None
        if names is not None:
            try:  # memory-mapped: only the tensors asked for are read
                state = torch.load(str(path), map_location="cpu", weights_only=True,
                                   mmap=True)
            except Exception:  # noqa: BLE001 - not a zip pickle: read it whole below
                state = None
        if state is None:
            state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same user error
        raise fail(field, path, f"cannot be read as a checkpoint ({type(e).__name__}: "
                   f"{str(e)[:200]})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor)
                                              for v in state.values()):
        raise fail(field, path, "is not a flat {name: tensor} state dict")
    if names is None:
        return state
    return {n: t.clone() for n, t in state.items() if n in names}


def read_tensors(path: Path, field: str, names: set[str] | None = None
                 ) -> dict[str, torch.Tensor]:
    """All tensors of ``path`` (``names``: only those, reading no more than needed): a
    ``.safetensors`` file, a ``torch.save`` pickle (loaded with ``weights_only=True``: no
    code runs) or a ``*.index.json`` of shards (with ``names``, only the shards that hold
    them)."""
    path = Path(path)
    if path.name.endswith(".index.json"):
        try:
            where = json.loads(path.read_text())["weight_map"]
            shards = sorted({s for n, s in where.items() if names is None or n in names})
        except (ValueError, KeyError, AttributeError, TypeError):
            raise fail(field, path, "has no weight_map") from None
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            if "/" in shard or shard.startswith("."):
                raise fail(field, path, f"names a shard outside the folder: {shard!r}")
            state.update(_load_one(path.parent / shard, field, names))
        return state
    return _load_one(path, field, names)


def shape(t: torch.Tensor) -> list[int]:
    """``t``'s shape as a plain list (for messages)."""
    return list(t.shape)


@dataclass
class TargetParts:
    """What an imported EAGLE drafter takes from its target: the HF ``config``, the
    input embedding ``embed [V, H]`` and the LM head ``lm_head [V, H]``."""

    config: object
    embed: torch.Tensor
    lm_head: torch.Tensor


def target_parts(target: nn.Module | str | Path | None, field: str) -> TargetParts | None:
    """The embedding and LM head of ``target``: a loaded HF causal LM, or its folder /
    hub id / ``models:/`` URI (loaded here, in float32). None when ``target`` is None."""
    if target is None:
        return None
    if not isinstance(target, nn.Module):
        from speclab.models.loading import load_model

        target = load_model(str(target), field="target")
    head = target.get_output_embeddings()
    if head is None:
        raise DrafterFormatError(f"{field}: the target has no LM head "
                                 f"({type(target).__name__})")
    return TargetParts(target.config, target.get_input_embeddings().weight.detach(),
                       head.weight.detach())

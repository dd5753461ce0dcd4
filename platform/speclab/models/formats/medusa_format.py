"""Medusa's own format (FasterDecoding/Medusa ``medusa_model.py``; TGI reads it too).

``config.json``: ``medusa_num_heads`` (K), ``medusa_num_layers`` (L, residual blocks per
head) and ``base_model_name_or_path`` (the target). ``medusa_lm_head.safetensors`` (or
``medusa_lm_head.pt``): the ``medusa_head`` ModuleList's state dict, head ``k`` an
``nn.Sequential`` of L ``ResBlock`` s and a linear LM head::

    <k>.<j>.linear.weight [H, H], <k>.<j>.linear.bias [H]   (j < L; x + SiLU(W x + b))
    <k>.<L>.weight [V, H]                                   (no bias)

(keys may carry a ``medusa_head.`` prefix). speclab's heads are that with L = 1
(``w1[k]``, ``b1[k]``, ``w2[k]`` of :class:`~speclab.families.medusa.model.MedusaHeads`); L = 0
loads exactly as ``w1 = 0, b1 = 0`` (``SiLU(0) = 0``). L > 1 is refused: Medusa's code
repeats ONE block L times, which speclab's heads cannot hold. speclab's ``tree.json``
(the heads' calibration) travels beside the files when present; Medusa ignores it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from speclab.families.medusa.model import MedusaHeads, MedusaMeta
from speclab.models.formats.files import (
    DrafterFormatError,
    fail,
    read_config,
    read_tensors,
    shape,
)


def read_medusa(folder: Path, target_config, field: str) -> MedusaHeads:
    """The Medusa-format heads in ``folder`` as MedusaHeads (no target fingerprint:
    only their shapes are checked against ``target_config``, the target's HF config,
    when given). Errors name the file, the field and what was found."""
    folder = Path(folder)
    cfg = read_config(folder, field)
    where = folder / "config.json"
    k, layers = cfg.get("medusa_num_heads"), cfg.get("medusa_num_layers", 1)
    if not isinstance(k, int) or k < 1:
        raise fail(field, where, f"medusa_num_heads={k!r}: a positive integer is needed")
    if layers not in (0, 1):
        raise fail(field, where, f"medusa_num_layers={layers!r}: speclab's heads hold one "
                   f"residual block per head (Medusa's code repeats one block "
                   f"medusa_num_layers times)")
    file = next((folder / n for n in ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
                 if (folder / n).exists()), None)
    if file is None:
        raise fail(field, folder, "has no medusa_lm_head.safetensors / medusa_lm_head.pt")
    state = {n.removeprefix("medusa_head."): t for n, t in read_tensors(file, field).items()}

    def get(name: str) -> torch.Tensor:
        if name not in state:
            raise fail(field, file, f"has no {name} (head {name.split('.')[0]} of the "
                       f"medusa_num_heads={k}, medusa_num_layers={layers} in config.json)")
        return state.pop(name)

    w2 = [get(f"{i}.{layers}.weight") for i in range(k)]
    if w2[0].ndim != 2:
        raise fail(field, file, f"0.{layers}.weight has shape {shape(w2[0])}, not "
                   f"[vocab_size, hidden_size]")
    v, h = w2[0].shape
    if target_config is not None and (h, v) != (int(target_config.hidden_size),
                                                int(target_config.vocab_size)):
        raise fail(field, file, f"0.{layers}.weight (head 0's LM head) has shape "
                   f"{shape(w2[0])} = [vocab_size, hidden_size], but the target has "
                   f"vocab_size={target_config.vocab_size}, hidden_size="
                   f"{target_config.hidden_size}")
    heads = MedusaHeads(MedusaMeta(target=str(cfg.get("base_model_name_or_path") or ""),
                                   target_architecture="", hidden_size=int(h),
                                   vocab_size=int(v), heads=k))
    want = {"w": (h, h), "b": (h,), "w2": (v, h)}
    with torch.no_grad():
        for i in range(k):
            parts = [("w2", f"{i}.{layers}.weight", w2[i], heads.w2)]
            if layers == 1:
                parts += [("w", f"{i}.0.linear.weight", get(f"{i}.0.linear.weight"), heads.w1),
                          ("b", f"{i}.0.linear.bias", get(f"{i}.0.linear.bias"), heads.b1)]
            for kind, name, t, param in parts:
                if tuple(t.shape) != want[kind]:
                    raise fail(field, file, f"{name} has shape {shape(t)}, expected "
                               f"{list(want[kind])} (hidden_size={h}, vocab_size={v})")
                param[i].copy_(t.float())
    if state:
        left = sorted(state)
        raise fail(field, file, f"holds tensors {k} heads of {layers} block(s) do not have: "
                   f"{left[:5]}{' ...' if len(left) > 5 else ''}")
    tree = folder / "tree.json"
    heads.tree = json.loads(tree.read_text()) if tree.exists() else None
    return heads.eval()


def write_medusa(heads: MedusaHeads, out: Path, target: str | None = None) -> Path:
    """Write ``heads`` in Medusa's format: ``config.json`` (``medusa_num_heads``,
    ``medusa_num_layers: 1``, ``base_model_name_or_path``: ``target`` or the heads' own
    target name) and ``medusa_lm_head.safetensors``; ``tree.json`` when calibrated."""
    from safetensors.torch import save_file

    name = target or heads.meta.target
    if not name:
        raise DrafterFormatError("--format medusa: base_model_name_or_path (the target) is "
                                 "unknown: name the target (--target)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"medusa_num_heads": heads.meta.heads, "medusa_num_layers": 1,
           "base_model_name_or_path": str(name), "hidden_size": heads.meta.hidden_size,
           "vocab_size": heads.meta.vocab_size}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    state = {}
    for i in range(heads.meta.heads):
        state[f"{i}.0.linear.weight"] = heads.w1[i].detach().float().cpu().contiguous()
        state[f"{i}.0.linear.bias"] = heads.b1[i].detach().float().cpu().contiguous()
        state[f"{i}.1.weight"] = heads.w2[i].detach().float().cpu().contiguous()
    save_file(state, str(out / "medusa_lm_head.safetensors"), metadata={"format": "pt"})
    if heads.tree is not None:
        (out / "tree.json").write_text(json.dumps(heads.tree, indent=1))
    return out

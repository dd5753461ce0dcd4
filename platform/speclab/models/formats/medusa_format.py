"""Medusa's own formats (FasterDecoding/Medusa; TGI reads the heads-only one too).

Medusa's code builds head ``k`` as ``nn.Sequential(*([ResBlock(H)] * L), nn.Linear(H, V,
bias=False))``: the list repeats ONE ``ResBlock`` module ``L`` times (``L``:
``medusa_num_layers``), so the block's weights are shared and its state dict holds ``L``
equal copies. The ``medusa_head`` ModuleList's state dict::

    <k>.<j>.linear.weight [H, H], <k>.<j>.linear.bias [H]   (j < L; x + SiLU(W x + b))
    <k>.<L>.weight [V, H]                                   (the head's LM head, no bias)

Three layouts hold it (``config.json``: ``medusa_num_heads`` K, ``medusa_num_layers`` L):

- MEDUSA-1 heads (``medusa_model.py``): ``medusa_lm_head.safetensors`` or
  ``medusa_lm_head.pt`` with the keys above (a ``medusa_head.`` prefix is stripped);
  ``base_model_name_or_path``: the target.
- legacy "version 2" heads (``medusa_model_legacy.py`` / ``train_legacy.py``, config
  ``version: "2"``): the same files with the residual blocks only, no ``<k>.<L>.weight``;
  the logits are the TARGET's LM head applied to each head's output. They load with
  ``w2[k]`` = a copy of the target's LM head (so the target is needed,
  ``MedusaMeta.shared_lm_head`` records it and ``fingerprint`` names that target). As in
  TGI, the files' tensors decide: no head with an LM head of its own = version 2.
- MEDUSA-2 models (``MedusaModelLlama`` / the axolotl recipe): the fine-tuned model's
  folder, whose weights (``model.safetensors``, ``pytorch_model.bin`` or their sharded
  index) hold ``medusa_head.<k>...`` beside the backbone, and whose ``config.json`` has
  ``medusa_num_heads``. Only those tensors and the LM head are read; the heads' target is
  that same folder (pass it as the target: its LM head's fingerprint is checked).

Loaded as speclab's heads (:class:`~speclab.families.medusa.model.MedusaHeads`): the block
is ``w1[k]``, ``b1[k]`` applied ``meta.blocks = L`` times; L = 0 loads as ``w1 = 0, b1 =
0`` (``SiLU(0) = 0``). Copies of a block that differ are refused (Medusa's code would load
only the last one; vLLM's and TGI's separate blocks would read them all): no reading
computes what every runtime does. ``medusa_num_heads`` heads load, as Medusa's loaders
(``load_state_dict(strict=False)``) and TGI (heads read by name) do; further heads in the
file are ignored with a logged warning. speclab's ``tree.json`` (the heads' calibration)
travels beside the files when present; Medusa ignores it.

:func:`write_medusa` writes ``medusa_lm_head.pt`` (``torch.save`` of the state dict,
what Medusa's loaders read) and ``medusa_lm_head.safetensors`` (TGI) with the keys above.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path

import torch

from speclab.families.medusa.model import MedusaHeads, MedusaMeta, weight_fingerprint
from speclab.models.formats.detect import tensor_names
from speclab.models.formats.files import (
    DrafterFormatError,
    TargetParts,
    fail,
    read_config,
    read_tensors,
    shape,
    weight_file,
)

LOG = logging.getLogger(__name__)

#: Medusa's heads-only files, in the order they are looked for
HEAD_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
#: a MEDUSA-2 model's prefix of its heads' tensors
PREFIX = "medusa_head."
_KEY = re.compile(r"^(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")


def read_medusa(folder: Path, target_config, field: str,
                target: Callable[[], TargetParts | None] | None = None,
                advice: str = "") -> MedusaHeads:
    """The Medusa heads in ``folder`` (any layout of the module docstring) as float32
    MedusaHeads on the CPU; their shapes are checked against ``target_config`` (the
    target's HF config) when given. ``target``: called only for version-2 heads, it
    gives the target's LM head (None: no target, an error that says to pass one;
    ``advice`` ends that message). Errors name the file, the field and the flag."""
    folder = Path(folder)
    cfg = read_config(folder, field)
    where = folder / "config.json"
    k, layers = cfg.get("medusa_num_heads"), cfg.get("medusa_num_layers", 1)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise fail(field, where, f"medusa_num_heads={k!r}: a positive integer is needed")
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 0:
        raise fail(field, where, f"medusa_num_layers={layers!r}: a non-negative integer "
                   f"is needed")
    file = next((folder / n for n in HEAD_FILES if (folder / n).exists()), None)
    own_lm: torch.Tensor | None = None  # a MEDUSA-2 model's own LM head
    if file is not None:
        state = {n.removeprefix(PREFIX): t for n, t in read_tensors(file, field).items()}
    else:
        file = weight_file(folder)
        names = tensor_names(file, field) if file is not None else set()
        if not any(n.startswith(PREFIX) for n in names):
            raise fail(field, folder, f"has no {' / '.join(HEAD_FILES)} (MEDUSA-1 heads) and "
                       f"no model weights with MEDUSA-2's {PREFIX}* tensors (config.json "
                       f"has medusa_num_heads={k})")
        state, own_lm = _read_medusa2(file, names, cfg, field)
    _drop_extra_heads(state, k, file, field)
    has_lm = [f"{i}.{layers}.weight" in state for i in range(k)]
    if any(has_lm) and not all(has_lm):
        i = has_lm.index(False)
        raise fail(field, file, f"has no {i}.{layers}.weight (head {i}'s LM head) while "
                   f"head {has_lm.index(True)} has one (medusa_num_heads={k}, "
                   f"medusa_num_layers={layers} in config.json)")
    shared = not any(has_lm)
    if shared and not state:
        raise fail(field, file, "holds no Medusa head tensors")
    fingerprint = weight_fingerprint(own_lm) if own_lm is not None else ""
    if not shared:
        lm = state[f"0.{layers}.weight"]
        lm_name = f"0.{layers}.weight (head 0's LM head)"
    elif own_lm is not None:
        lm, lm_name = own_lm, "the model's LM head"
    else:
        parts = target() if target is not None else None
        if parts is None:
            raise fail(field, file, f"holds Medusa 'version 2' heads (residual blocks only, "
                       f"no 0.{layers}.weight): Medusa's medusa_model_legacy.py puts them "
                       f"through the target's LM head, so they load only next to their "
                       f"target{advice}")
        lm = parts.lm_head.detach().float().cpu()
        lm_name, fingerprint = "the target's LM head", weight_fingerprint(lm)
    if lm.ndim != 2:
        raise fail(field, file, f"{lm_name} has shape {shape(lm)}, not "
                   f"[vocab_size, hidden_size]")
    v, h = lm.shape
    if target_config is not None and (h, v) != (int(target_config.hidden_size),
                                                int(target_config.vocab_size)):
        raise fail(field, file, f"{lm_name} has shape {shape(lm)} = [vocab_size, "
                   f"hidden_size], but the target has vocab_size={target_config.vocab_size}"
                   f", hidden_size={target_config.hidden_size}")
    target_name = str(folder) if own_lm is not None else str(
        cfg.get("base_model_name_or_path") or "")
    heads = MedusaHeads(MedusaMeta(target=target_name, target_architecture="",
                                   hidden_size=int(h), vocab_size=int(v), heads=k,
                                   fingerprint=fingerprint, blocks=max(layers, 1),
                                   shared_lm_head=shared))
    _fill(heads, state, layers, lm if shared else None, file, field)
    if state:
        left = sorted(state)
        raise fail(field, file, f"holds tensors {k} heads of {layers} block(s) do not have: "
                   f"{left[:5]}{' ...' if len(left) > 5 else ''} (medusa_num_heads={k}, "
                   f"medusa_num_layers={layers} in config.json)")
    tree = folder / "tree.json"
    heads.tree = json.loads(tree.read_text()) if tree.exists() else None
    return heads.eval()


def _fill(heads: MedusaHeads, state: dict[str, torch.Tensor], layers: int,
          shared_lm: torch.Tensor | None, file: Path, field: str) -> None:
    """Copy each head's block (its ``layers`` copies checked equal) and LM head (or
    ``shared_lm``) from ``state`` into ``heads``, popping what it used."""
    k, h, v = heads.meta.heads, heads.meta.hidden_size, heads.meta.vocab_size
    want = {"linear.weight": (h, h), "linear.bias": (h,), "weight": (v, h)}

    def get(name: str) -> torch.Tensor:
        if name not in state:
            raise fail(field, file, f"has no {name} (head {name.split('.')[0]} of the "
                       f"medusa_num_heads={k}, medusa_num_layers={layers} in config.json)")
        t = state.pop(name)
        kind = name.split(".", 2)[2]
        if tuple(t.shape) != want[kind]:
            raise fail(field, file, f"{name} has shape {shape(t)}, expected "
                       f"{list(want[kind])} (hidden_size={h}, vocab_size={v})")
        return t

    with torch.no_grad():
        for i in range(k):
            heads.w2[i].copy_(shared_lm if shared_lm is not None
                              else get(f"{i}.{layers}.weight").float())
            if layers == 0:
                continue
            for part, param in (("linear.weight", heads.w1), ("linear.bias", heads.b1)):
                first = get(f"{i}.0.{part}")
                for j in range(1, layers):
                    if not torch.equal(get(f"{i}.{j}.{part}"), first):
                        raise fail(field, file, f"{i}.0.{part} and {i}.{j}.{part} differ: "
                                   f"medusa_num_layers={layers} means ONE residual block "
                                   f"applied {layers} times in Medusa's code "
                                   f"(nn.Sequential(*[ResBlock(H)] * medusa_num_layers)), "
                                   f"which saves equal copies; separate blocks are not "
                                   f"what Medusa computes and do not load")
                param[i].copy_(first.float())


def _drop_extra_heads(state: dict[str, torch.Tensor], k: int, file: Path,
                      field: str) -> None:
    """Remove (and log) heads ``>= k`` from ``state``: Medusa builds
    ``medusa_num_heads`` heads and loads with ``strict=False``, ignoring the others."""
    extra = sorted({int(m.group(1)) for n in state if (m := _KEY.match(n))
                    and int(m.group(1)) >= k})
    if not extra:
        return
    for n in [n for n in state if (m := _KEY.match(n)) and int(m.group(1)) >= k]:
        del state[n]
    LOG.warning("%s: %s: holds %d more head(s) (%s) than medusa_num_heads=%d in config.json: "
                "they are ignored, as Medusa's loaders do (they build medusa_num_heads heads "
                "and load with strict=False)", field, file, len(extra),
                ", ".join(map(str, extra)), k)


def _read_medusa2(file: Path, names: set[str], cfg: dict, field: str
                  ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """A MEDUSA-2 model's ``medusa_head.*`` tensors (prefix stripped) and its own LM head
    (``lm_head.weight``, or the embedding when tied; None: neither is there), read from
    ``file`` (one weights file or a sharded index) without the backbone's other
    tensors."""
    lm_name = "lm_head.weight"
    if lm_name not in names and cfg.get("tie_word_embeddings"):
        lm_name = next((n for n in sorted(names) if n.endswith("embed_tokens.weight")), "")
    wanted = {n for n in names if n.startswith(PREFIX)} | ({lm_name} & names)
    got = read_tensors(file, field, wanted)
    lm = got.pop(lm_name, None)
    return {n.removeprefix(PREFIX): t for n, t in got.items()}, lm


def write_medusa(heads: MedusaHeads, out: Path, target: str | None = None) -> Path:
    """Write ``heads`` in Medusa's format: ``config.json`` (``medusa_num_heads``,
    ``medusa_num_layers`` = ``meta.blocks``, ``base_model_name_or_path``: ``target`` or
    the heads' own target name), ``medusa_lm_head.pt`` (``torch.save`` of Medusa's
    ``medusa_head`` state dict, unprefixed keys: what Medusa's loaders read; the repeated
    block's copies are one tensor, as in Medusa's own state dict),
    ``medusa_lm_head.safetensors`` (the same tensors, for TGI) and ``tree.json`` when
    calibrated. Every head carries its LM head ``w2[k]`` (version-2 heads are written in
    MEDUSA-1's layout)."""
    from safetensors.torch import save_file

    name = target or heads.meta.target
    if not name:
        raise DrafterFormatError("--format medusa: base_model_name_or_path (the target) is "
                                 "unknown: name the target (--target)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    layers = heads.meta.blocks
    cfg = {"medusa_num_heads": heads.meta.heads, "medusa_num_layers": layers,
           "base_model_name_or_path": str(name), "hidden_size": heads.meta.hidden_size,
           "vocab_size": heads.meta.vocab_size}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))

    def own(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", torch.float32).clone()  # not a view of the stack

    state: dict[str, torch.Tensor] = {}
    for i in range(heads.meta.heads):
        w, b = own(heads.w1[i]), own(heads.b1[i])
        for j in range(layers):
            state[f"{i}.{j}.linear.weight"], state[f"{i}.{j}.linear.bias"] = w, b
        state[f"{i}.{layers}.weight"] = own(heads.w2[i])
    torch.save(state, out / "medusa_lm_head.pt")
    seen: set[int] = set()
    single = {}  # safetensors holds no shared tensors: a copy of each repeat
    for n, t in state.items():
        single[n] = t.clone() if id(t) in seen else t
        seen.add(id(t))
    save_file(single, str(out / "medusa_lm_head.safetensors"), metadata={"format": "pt"})
    if heads.tree is not None:
        (out / "tree.json").write_text(json.dumps(heads.tree, indent=1))
    return out

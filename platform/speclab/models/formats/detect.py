"""Which format a drafter folder is in: :func:`detect_drafter_format`.

======================  ======================================================  ===========
format                  how it is recognised                                    loads as
======================  ======================================================  ===========
``speclab-eagle``       ``config.json`` ``kind: speclab-eagle``                 EagleModel
                                                                                / Eagle3Model
``speclab-medusa``      ``config.json`` ``kind: speclab-medusa``                MedusaHeads
``speculators``         ``config.json`` ``speculators_model_type: eagle``       EagleModel
``speculators-eagle3``  ``config.json`` ``speculators_model_type: eagle3``      Eagle3Model
``eagle``               EAGLE-1/2 / HASS research code: a LLaMA ``config.json``  EagleModel
                        and ``model.safetensors`` / ``pytorch_model.bin`` with
                        ``fc.weight`` and ``layers.0.*``
``eagle3``              EAGLE-3 research code / SpecForge: ``config.json`` with  Eagle3Model
                        ``draft_vocab_size`` or an ``*Eagle3*`` architecture, or
                        weights with ``midlayer.*`` / ``d2t`` / ``t2d``
``medusa``              ``config.json`` ``medusa_num_heads``,                   MedusaHeads
                        ``medusa_lm_head.*`` (MEDUSA-1 / legacy heads) or model
                        weights with ``medusa_head.*`` (a MEDUSA-2 model)
======================  ======================================================  ===========

:func:`drafter_feature_spec` tells which target states an EAGLE-family folder reads
(speclab's ``feature_layers``; a public EAGLE-3 folder's named layers, or ``"eagle3"``:
EAGLE-3's default for the target).
"""

from __future__ import annotations

from pathlib import Path

from speclab.models.formats.files import (
    WEIGHT_FILES,
    DrafterFormatError,
    fail,
    read_config,
    read_tensors,
    weight_file,
)

SPECLAB_EAGLE, SPECLAB_MEDUSA = "speclab-eagle", "speclab-medusa"
SPECULATORS, EAGLE, MEDUSA = "speculators", "eagle", "medusa"
SPECULATORS_EAGLE3, EAGLE3 = "speculators-eagle3", "eagle3"
#: every format a drafter folder may be in
FORMATS = (SPECLAB_EAGLE, SPECLAB_MEDUSA, SPECULATORS, SPECULATORS_EAGLE3, EAGLE, EAGLE3,
           MEDUSA)
#: the formats that hold an EAGLE-family feature drafter (EagleModel or Eagle3Model)
EAGLE_FORMATS = (SPECLAB_EAGLE, SPECULATORS, SPECULATORS_EAGLE3, EAGLE, EAGLE3)
#: the public formats of EAGLE-3 drafters
EAGLE3_FORMATS = (SPECULATORS_EAGLE3, EAGLE3)
#: the formats that hold Medusa heads
MEDUSA_FORMATS = (SPECLAB_MEDUSA, MEDUSA)
MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


def detect_drafter_format(folder: str | Path, field: str = "drafter",
                          expect: str = "drafter") -> str:
    """The format of the drafter in ``folder``, one of :data:`FORMATS`.

    Raises DrafterFormatError (a ValueError starting with ``field``) naming the file,
    the field and what was found for a folder that matches no format (``"... holds no
    <expect>: ..."``) or a speculators algorithm other than eagle / eagle3. Only
    ``config.json`` is read, plus the weights' tensor names for the research formats (no
    marker of their own in their config)."""
    folder = Path(folder)
    cfg = read_config(folder, field)
    where = folder / "config.json"
    kind = cfg.get("kind")
    if kind in (SPECLAB_EAGLE, SPECLAB_MEDUSA):
        return kind
    if "speculators_model_type" in cfg or "speculators_config" in cfg:
        algo = cfg.get("speculators_model_type")
        if algo in ("eagle", "eagle3"):
            return SPECULATORS if algo == "eagle" else SPECULATORS_EAGLE3
        raise fail(field, where, f"speculators_model_type={algo!r}: only 'eagle' (speculators' "
                   f"EAGLE-1/2 and HASS drafter) and 'eagle3' load")
    if "medusa_num_heads" in cfg:
        if any((folder / name).exists() for name in MEDUSA_FILES):
            return MEDUSA
        weights = weight_file(folder)  # a MEDUSA-2 model: its heads inside its weights
        if weights is not None and any(n.startswith("medusa_head.")
                                       for n in tensor_names(weights, field)):
            return MEDUSA
        raise fail(field, folder, f"config.json has medusa_num_heads="
                   f"{cfg['medusa_num_heads']!r} but neither of {list(MEDUSA_FILES)} is "
                   f"there, nor model weights with medusa_head.* (a MEDUSA-2 model)")
    if eagle3_config(cfg):
        return EAGLE3
    weights = weight_file(folder)
    if weights is None:
        raise fail(field, folder, f"holds no {expect}: config.json has no kind, "
                   f"speculators_model_type or medusa_num_heads, and there is no "
                   f"{' / '.join(WEIGHT_FILES)} with EAGLE's fc.weight")
    keys = tensor_names(weights, field)
    if _eagle3_keys(keys):
        return EAGLE3
    if "fc.weight" in keys and any(k.startswith("layers.0.") for k in keys):
        return EAGLE
    found = sorted(keys)[:4]
    raise fail(field, weights, f"holds no {expect}: config.json has no kind, "
               f"speculators_model_type or medusa_num_heads, and the weights have neither "
               f"fc.weight + layers.0.* of an EAGLE-1/2 drafter nor the midlayer.* / d2t / "
               f"t2d of an EAGLE-3 one (found {found}{' ...' if len(keys) > 4 else ''})")


def eagle3_config(cfg: dict) -> bool:
    """An EAGLE-3 research / SpecForge ``config.json``: ``draft_vocab_size`` or an
    ``*Eagle3*`` architecture."""
    archs = cfg.get("architectures") or []
    return "draft_vocab_size" in cfg or any("eagle3" in str(a).lower() for a in archs)


def _eagle3_keys(keys) -> bool:
    return any(k in ("d2t", "t2d") or k.startswith("midlayer.") for k in keys)


def tensor_names(path: Path, field: str) -> set[str]:
    """The tensor names of a weights file without reading the tensors where the format
    allows (safetensors headers, a sharded index's weight map, a memory-mapped
    ``torch.save`` zip read with ``weights_only``)."""
    import json

    import torch

    path = Path(path)
    try:
        if path.name.endswith(".index.json"):
            return set(json.loads(path.read_text())["weight_map"])
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), "pt") as f:
                return set(f.keys())
        state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        if isinstance(state, dict):
            return set(state)
    except Exception:  # noqa: BLE001 - unreadable: read_tensors below says why
        pass
    return set(read_tensors(path, field))


def drafter_feature_spec(folder: str | Path, field: str = "eagle_model"):
    """The target features the EAGLE-family drafter in ``folder`` reads
    (:mod:`speclab.decoding.features`): None (the last layer's) for EAGLE-1/2 formats,
    the ``feature_layers`` of a speclab EAGLE-3 drafter, the layers a public EAGLE-3
    checkpoint names (speclab's indices, ascending; :mod:`.eagle3_layers`) or
    ``"eagle3"`` (EAGLE-3's default for the target) when it names none. Reads
    ``config.json`` (and, for a folder with no marker there, the weights' tensor
    names)."""
    from speclab.models.formats.eagle3_layers import named_layers

    folder = Path(folder)
    cfg = read_config(folder, field)
    if cfg.get("kind") == SPECLAB_EAGLE:
        layers = cfg.get("feature_layers")
        return tuple(int(i) for i in layers) if layers else None
    try:
        fmt = detect_drafter_format(folder, field)
    except DrafterFormatError:
        return None  # not a drafter: its loader says why
    if fmt not in EAGLE3_FORMATS:
        return None
    named = named_layers(cfg, folder / "config.json", field, sglang=fmt == EAGLE3)
    return named if named is not None else "eagle3"


def check_kind(fmt: str, want: tuple[str, ...], folder: Path, field: str, what: str) -> None:
    """A DrafterFormatError unless ``fmt`` is one of ``want`` (``what``: the drafter kind
    the field expects, e.g. "an EAGLE drafter")."""
    if fmt not in want:
        held = "Medusa heads" if fmt in MEDUSA_FORMATS else "an EAGLE drafter"
        raise DrafterFormatError(f"{field}: {folder} holds {held} ({fmt} format), not "
                                 f"{what}")


__all__ = ["DrafterFormatError", "detect_drafter_format", "drafter_feature_spec", "FORMATS",
           "EAGLE_FORMATS", "EAGLE3_FORMATS", "MEDUSA_FORMATS", "check_kind", "tensor_names"]

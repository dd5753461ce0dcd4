"""Which format a drafter folder is in: :func:`detect_drafter_format`.

==================  ==========================================================  ============
format              how it is recognised                                        loads as
==================  ==========================================================  ============
``speclab-eagle``   ``config.json`` ``kind: speclab-eagle``                     EagleModel
``speclab-medusa``  ``config.json`` ``kind: speclab-medusa``                    MedusaHeads
``speculators``     ``config.json`` ``speculators_model_type: eagle``           EagleModel
``eagle``           EAGLE-1/2 / HASS research code: a LLaMA ``config.json`` and  EagleModel
                    ``model.safetensors`` / ``pytorch_model.bin`` with
                    ``fc.weight`` and ``layers.0.*``
``medusa``          ``config.json`` ``medusa_num_heads``, ``medusa_lm_head.*``  MedusaHeads
==================  ==========================================================  ============

EAGLE-3 (``speculators_model_type: eagle3``; research checkpoints with
``draft_vocab_size``, ``d2t`` / ``t2d``, ``midlayer.*`` or a fused ``fc`` over three hidden
states) is recognised and refused: speclab has no EAGLE-3 drafter yet.
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
#: every format a drafter folder may be in
FORMATS = (SPECLAB_EAGLE, SPECLAB_MEDUSA, SPECULATORS, EAGLE, MEDUSA)
#: the formats that hold an EAGLE feature drafter (speclab's EagleModel)
EAGLE_FORMATS = (SPECLAB_EAGLE, SPECULATORS, EAGLE)
#: the formats that hold Medusa heads
MEDUSA_FORMATS = (SPECLAB_MEDUSA, MEDUSA)
MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")

EAGLE3 = "EAGLE-3 is not supported yet (speclab has no EAGLE-3 drafter; EAGLE-1/2, HASS " \
         "and speculators 'eagle' checkpoints load)"


def detect_drafter_format(folder: str | Path, field: str = "drafter",
                          expect: str = "drafter") -> str:
    """The format of the drafter in ``folder``, one of :data:`FORMATS`.

    Raises DrafterFormatError (a ValueError starting with ``field``) naming the file,
    the field and what was found for an EAGLE-3 checkpoint or a folder that matches no
    format (``"... holds no <expect>: ..."``). Only ``config.json`` is read, plus the
    weights' key names for the EAGLE research format (no marker of its own in its
    config)."""
    folder = Path(folder)
    cfg = read_config(folder, field)
    where = folder / "config.json"
    kind = cfg.get("kind")
    if kind in (SPECLAB_EAGLE, SPECLAB_MEDUSA):
        return kind
    if "speculators_model_type" in cfg or "speculators_config" in cfg:
        algo = cfg.get("speculators_model_type")
        if algo == "eagle":
            return SPECULATORS
        if algo == "eagle3":
            raise fail(field, where, f"speculators_model_type='eagle3': {EAGLE3}")
        raise fail(field, where, f"speculators_model_type={algo!r}: only 'eagle' loads "
                   f"(speculators' EAGLE-1/2 and HASS drafter)")
    if "medusa_num_heads" in cfg:
        if not any((folder / name).exists() for name in MEDUSA_FILES):
            raise fail(field, folder, f"config.json has medusa_num_heads="
                       f"{cfg['medusa_num_heads']!r} but neither of {list(MEDUSA_FILES)} "
                       f"is there")
        return MEDUSA
    if "draft_vocab_size" in cfg:
        raise fail(field, where, f"draft_vocab_size={cfg['draft_vocab_size']!r} marks an "
                   f"EAGLE-3 drafter: {EAGLE3}")
    weights = weight_file(folder)
    if weights is None:
        raise fail(field, folder, f"holds no {expect}: config.json has no kind, "
                   f"speculators_model_type or medusa_num_heads, and there is no "
                   f"{' / '.join(WEIGHT_FILES)} with EAGLE's fc.weight")
    keys = set(read_tensors(weights, field))
    eagle3 = sorted(k for k in keys if k in ("d2t", "t2d") or k.startswith("midlayer."))
    if eagle3:
        raise fail(field, weights, f"holds {eagle3[:3]}, the tensors of an EAGLE-3 "
                   f"drafter: {EAGLE3}")
    if "fc.weight" in keys and any(k.startswith("layers.0.") for k in keys):
        return EAGLE
    found = sorted(keys)[:4]
    raise fail(field, weights, f"holds no {expect}: config.json has no kind, "
               f"speculators_model_type or medusa_num_heads, and the weights have no "
               f"fc.weight + layers.0.* of an EAGLE-1/2 drafter (found {found}"
               f"{' ...' if len(keys) > 4 else ''})")


def drafter_feature_spec(folder: str | Path, field: str = "eagle_model"):
    """The target features the EAGLE drafter in ``folder`` reads
    (:mod:`speclab.decoding.features`): None (the last layer's) for EAGLE-1/2 formats,
    the ``feature_layers`` of a speclab EAGLE-3 drafter. Only ``config.json`` is read."""
    cfg = read_config(Path(folder), field)
    if cfg.get("kind") == SPECLAB_EAGLE and cfg.get("feature_layers"):
        return tuple(int(i) for i in cfg["feature_layers"])
    return None


def check_kind(fmt: str, want: tuple[str, ...], folder: Path, field: str, what: str) -> None:
    """A DrafterFormatError unless ``fmt`` is one of ``want`` (``what``: the drafter kind
    the field expects, e.g. "an EAGLE drafter")."""
    if fmt not in want:
        held = "Medusa heads" if fmt in MEDUSA_FORMATS else "an EAGLE drafter"
        raise DrafterFormatError(f"{field}: {folder} holds {held} ({fmt} format), not "
                                 f"{what}")


__all__ = ["DrafterFormatError", "detect_drafter_format", "drafter_feature_spec", "FORMATS",
           "EAGLE_FORMATS", "MEDUSA_FORMATS", "check_kind"]

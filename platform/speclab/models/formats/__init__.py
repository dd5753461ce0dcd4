"""Drafter checkpoint formats: public EAGLE / EAGLE-3 / HASS / Medusa / speculators
checkpoints in, speclab-trained drafters out (issue 36).

=============================  ======  =====  ==========================================
format                         in      out    module
=============================  ======  =====  ==========================================
speclab (EAGLE, EAGLE-3,       yes     yes    :mod:`speclab.families.eagle.model`, ``.eagle3``,
Medusa)                                       ``.medusa``
EAGLE-1/2, HASS research       yes     yes    :mod:`.eagle_research`
EAGLE-3 research, SpecForge    yes     yes    :mod:`.eagle_research`, :mod:`.eagle3_layers`
speculators ``eagle``          yes     yes    :mod:`.speculators` (what vLLM serves)
speculators ``eagle3``         yes     yes    :mod:`.speculators`, :mod:`.eagle3_layers`
Medusa                         yes     yes    :mod:`.medusa_format`
=============================  ======  =====  ==========================================

:func:`detect_drafter_format` tells a folder's format; the loaders every drafter name
goes through (:func:`~speclab.families.eagle.model.load_eagle`,
:func:`~speclab.families.medusa.model.load_medusa`) call :func:`load_public_eagle` /
:func:`load_public_medusa` for the public ones; :func:`export_drafter` writes any of
them in another format (``speclab export``; ``--format speculators`` / ``eagle`` write an
EAGLE-3 drafter in the EAGLE-3 variant of the format).
"""

from speclab.models.formats.convert import (
    EXPORT_FORMATS,
    check_exports,
    export_drafter,
    export_problem,
    load_drafter,
    load_public_eagle,
    load_public_medusa,
)
from speclab.models.formats.detect import FORMATS, detect_drafter_format, drafter_feature_spec
from speclab.models.formats.files import DrafterFormatError
from speclab.models.formats.speculators import VLLM_READS, VLLM_READS_EAGLE3

__all__ = ["EXPORT_FORMATS", "FORMATS", "VLLM_READS", "VLLM_READS_EAGLE3", "DrafterFormatError",
           "check_exports", "detect_drafter_format", "drafter_feature_spec", "export_drafter",
           "export_problem", "load_drafter", "load_public_eagle", "load_public_medusa"]

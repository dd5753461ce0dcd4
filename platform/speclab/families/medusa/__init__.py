"""The Medusa family: Medusa heads on the target's last feature, MEDUSA-1 (frozen
backbone) or MEDUSA-2 (joint fine-tuning), decoded by method ``medusa``.

One folder: :mod:`.drafter` and :mod:`.trees` (drafting from a tree template),
:mod:`.model` (the heads, save / load, the target check), :mod:`.training` (losses,
calibration), :mod:`.objectives`, :mod:`.task` (the Ray Train task) and :mod:`.stages`
(generate, train, calibrate, register, evaluate). This module is the declaration only.
"""

from speclab.families.objectives import Objective
from speclab.families.spec import TrainedFamily

_P = "speclab.families.medusa"
_HERE = f"{_P}.objectives"

FAMILY = TrainedFamily(
    name="medusa",
    summary="Medusa heads (MEDUSA-1, MEDUSA-2) on the target's last feature",
    task="medusa",
    task_module=f"{_P}.task",
    train_group="medusa",
    train_config="speclab.config.schema:MedusaTrainConfig",
    objectives=("medusa1", "medusa2"),
    method="medusa",
    artifact_field="medusa_model",
    data_kinds=f"{_P}.stages:group_kinds",
    prepare=f"{_P}.stages:prepare_medusa",
    is_artifact=f"{_P}.model:is_medusa_heads",
    check_artifact=f"{_P}.model:check_artifact",
    formats_in=("speclab", "medusa"),
    formats_out=("speclab", "medusa"),
    job="train_medusa",
)

#: the family's objectives (their knobs and losses: :mod:`.objectives`)
OBJECTIVES = (
    Objective("medusa1", "medusa", f"{_HERE}:medusa1_objective", f"{_P}.stages:data_kind",
              knobs=f"{_HERE}:Medusa1Knobs", doc="MEDUSA-1: heads on the frozen backbone"),
    Objective("medusa2", "medusa", f"{_HERE}:medusa2_objective", f"{_P}.stages:data_kind",
              knobs=f"{_HERE}:Medusa2Knobs", doc="MEDUSA-2: heads + backbone, jointly"),
)

"""The AtSpeed family: a small recommendation drafter aligned with the target's top-K
beams (AtSpeed-S / AtSpeed-R, or the KD baselines), for beam SD over item ids.

One folder: :mod:`.training` (alignment data, batches, losses), :mod:`.objectives`,
:mod:`.task` (the Ray Train task), :mod:`.stages` (alignment data and drafters on Ray)
and :mod:`.trial` (its Tune trial kind). Its drafter is a plain causal LM decoded by the
beam engine (:mod:`speclab.decoding.beam`), so no decoding method names it. This module
is the declaration only.
"""

from speclab.families.objectives import Objective
from speclab.families.spec import SweepSpec, TrainedFamily

_P = "speclab.families.atspeed"
_HERE = f"{_P}.objectives"

FAMILY = TrainedFamily(
    name="atspeed",
    summary="AtSpeed recommendation drafters (AtSpeed-S/R alignment, KD baselines)",
    task="rec_align",
    task_module=f"{_P}.task",
    train_group="rec_eval",
    train_config="speclab.config.schema:RecTrialConfig",
    objectives=("sft", "seq_kd", "word_kd", "tvd_kd", "atspeed_s", "atspeed_r"),
    job="recommend_eval",
    sweep=SweepSpec(
        kind="atspeed",
        groups=("rec", "rec_eval", "arch", "train", "scaling", "output"),
        heldout_metric="val_loss",
        trial=f"{_P}.trial:rec_trial",
        prepare=f"{_P}.trial:prepare_sweep",
        generate=f"{_P}.trial:generate_sweep",
        best=f"{_P}.trial:best_config",
        steps=f"{_P}.trial:sweep_steps",
        cpu_only=True,
        times=False,
    ),
)

_DOCS = {"sft": "L_Rec on the data", "seq_kd": "CE on the target's top beam",
         "word_kd": "forward KL along the target's beams",
         "tvd_kd": "total variation along the target's beams",
         "atspeed_s": "AtSpeed-S: L_Align-S (strict top-K verification)",
         "atspeed_r": "AtSpeed-R: L_Align-R (relaxed sampling verification)"}
#: the family's objectives (their knobs and losses: :mod:`.objectives`)
OBJECTIVES = tuple(
    Objective(name, "atspeed", f"{_HERE}:{name}_objective", "align",
              knobs=f"{_HERE}:AlignKnobs", fields={"alpha": "alpha", "k": "k"}, doc=doc)
    for name, doc in _DOCS.items())

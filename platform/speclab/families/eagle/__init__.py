"""The EAGLE family: EAGLE-1/2 and EAGLE-3 feature drafters, trained with the EAGLE,
HASS, TALF or EAGLE-3 objective, decoded by method ``eagle``.

One folder: :mod:`.drafter` / :mod:`.drafter_batch` (how it drafts, one row and many),
:mod:`.model` / :mod:`.model3` (the drafter networks, save / load, the target check),
:mod:`.training` (batches and losses), :mod:`.objectives` (the registry entries),
:mod:`.task` (the Ray Train task), :mod:`.stages` (generate, train, register, evaluate)
and :mod:`.trial` (its Tune trial kind). Its formats in and out are in
:mod:`speclab.models.formats`. This module is the family's declaration only.
"""

from speclab.families.objectives import Objective
from speclab.families.spec import SweepSpec, TrainedFamily

_P = "speclab.families.eagle"
_HERE = f"{_P}.objectives"
_CHECKS = f"{_P}.checks"

FAMILY = TrainedFamily(
    name="eagle",
    summary="EAGLE-1/2 and EAGLE-3 feature drafters (EAGLE, HASS, TALF, EAGLE-3 objectives)",
    task="eagle",
    task_module=f"{_P}.task",
    train_group="eagle",
    train_config="speclab.config.schema:EagleTrainConfig",
    objectives=("eagle", "hass", "talf", "eagle3"),
    method="eagle",
    artifact_field="eagle_model",
    data_kinds=f"{_P}.stages:group_kinds",
    prepare=f"{_P}.stages:prepare_eagle",
    train=f"{_P}.stages:train_register_evaluate_eagle",
    save=f"{_P}.stages:save_final_eagle",
    is_artifact=f"{_P}.model:is_eagle_model",
    check_artifact=f"{_P}.model:check_artifact",
    formats_in=("speclab", "eagle", "eagle3", "specforge", "speculators"),
    formats_out=("speclab", "eagle", "speculators"),
    job="distill_eagle",
    check_job=f"{_CHECKS}:windows_leave_tokens",
    draft_time=f"{_P}.trial:eagle_forward_time",
    sweep=SweepSpec(
        kind="eagle",
        groups=("models", "data", "decoding", "method", "retrieval", "corpus", "tokenizer",
                "distill", "eagle", "train", "scaling", "output"),
        heldout_metric="val_top1_miss",
        trial=f"{_P}.trial:eagle_trial",
        prepare=f"{_P}.trial:prepare_sweep",
        generate=f"{_P}.trial:generate_sweep",
        fixed_fields=("eagle.data", "eagle.data_prompt", "eagle.feature_layers",
                      "eagle.talf_top_k", "eagle.talf_depth"),
        validate=f"{_P}.trial:validate_sweep",
    ),
)

_FEATURES = {"w_reg": "w_reg", "w_cls": "w_cls", "feature_noise": "feature_noise",
             "feature_noise_len": "feature_noise_len"}

#: the family's objectives (their knobs, losses and checks: :mod:`.objectives`)
OBJECTIVES = (
    Objective("eagle", "eagle", f"{_HERE}:eagle_objective", f"{_CHECKS}:feature_kind",
              knobs=f"{_HERE}:EagleKnobs", fields=_FEATURES,
              check=f"{_CHECKS}:last_layer_drafter",
              extras=f"{_HERE}:noise", doc="EAGLE-1/2: feature regression + CE"),
    Objective("hass", "eagle", f"{_HERE}:hass_objective", f"{_CHECKS}:feature_kind",
              knobs=f"{_HERE}:HassKnobs",
              fields={**_FEATURES, "w_topk": "w_topk", "k": "hass_k", "steps": "hass_steps",
                      "detach": "hass_detach", "reduce": "hass_reduce"},
              check=f"{_CHECKS}:last_layer_drafter", validate=f"{_CHECKS}:hass_within_top_k",
              extras=f"{_HERE}:noise", doc="HASS: EAGLE + top-K distillation, n steps"),
    Objective("talf", "eagle", f"{_HERE}:talf_objective", f"{_CHECKS}:tree_kind",
              check=f"{_CHECKS}:offline_trees", validate=f"{_CHECKS}:talf_within_window",
              doc="TALF: CE over every node of target-built trees"),
    Objective("eagle3", "eagle", f"{_HERE}:eagle3_objective", f"{_CHECKS}:feature_kind",
              knobs=f"{_HERE}:Eagle3Knobs", fields={"steps": "ttt_steps", "decay": "ttt_decay"},
              check=f"{_CHECKS}:eagle3_drafter", doc="EAGLE-3: training-time test"),
)

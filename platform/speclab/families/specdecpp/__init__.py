"""The SpecDec++ family: an acceptance head on a frozen draft LM, decoded by method
``specdecpp`` (adaptive draft length: stop when the head's rejection risk passes the
threshold).

One folder: :mod:`.drafter` (the method), :mod:`.training` (acceptance data, features),
:mod:`.task` (the Ray Train task), :mod:`.stages` (generate, train, evaluate) and
:mod:`.trial` (its Tune trial kind, ``train_head``). The head network itself,
:class:`speclab.decoding.acceptance_head.AcceptanceHead`, is engine code. This module is
the declaration only.
"""

from speclab.families.spec import SweepSpec, TrainedFamily

_P = "speclab.families.specdecpp"

FAMILY = TrainedFamily(
    name="specdecpp",
    summary="SpecDec++ acceptance head on a frozen draft LM (weighted BCE)",
    task="head",
    task_module=f"{_P}.task",
    train_group="head",
    train_config="speclab.config.schema:HeadConfig",
    method="specdecpp",
    artifact_field="head",
    job="train_head",
    sweep=SweepSpec(
        kind="train_head",
        groups=("models", "data", "decoding", "method", "retrieval", "corpus", "tokenizer",
                "distill", "head", "train", "scaling", "output"),
        heldout_metric="heldout_bce",
        trial=f"{_P}.trial:head_trial",
        prepare=f"{_P}.trial:prepare_sweep",
        generate=f"{_P}.trial:generate_sweep",
        artifact="head-{trial}/head",
    ),
)

"""Compare EAGLE-family losses: the SALF & TALF paper's Table 2 shape on EAGLE drafters
(loss ``eagle`` / ``hass`` / ``talf`` x tree method -> tau, speedup, acceptance per draft
position).

    python -m jobs.compare_eagle --config experiments/compare_eagle.yaml [key=value ...]

The target's ``feat`` (and, for ``talf``, ``feat_tree``) shards are generated once into
a shared folder. With ``compare.finetune_steps`` 0 every loss in ``compare.losses`` trains
a drafter from scratch for ``train.steps``; with ``finetune_steps`` > 0 an EAGLE-loss base
drafter trains for ``train.steps`` first and every loss then continues from it for
``finetune_steps`` (the paper trains HASS and TALF on top of an EAGLE-trained drafter;
here the ``eagle`` row gets the same extra steps, so budgets are equal). Each drafter is
registered (``output.register_as``-<loss>) and evaluated with every method in ``methods``
(``eagle`` methods use it). Each loss is an MLflow child run of the comparison's parent
run, which gets the table (``loss_comparison.csv/json/txt``), tau per loss and method,
and acceptance per draft position (``acceptance_per_position.png``: EAGLE vs HASS vs TALF,
the HASS slide's figure).
"""

from __future__ import annotations

from speclab.pipelines.cli import run_dirs, start_job
from speclab.pipelines.comparison import comparison_rows, log_comparison
from speclab.pipelines.eagle import (
    generate_features,
    prepare_eagle,
    train_register_evaluate_eagle,
)


def main(argv: list[str] | None = None) -> int:
    job = start_job("compare_eagle", __doc__, argv, prepare_eagle)
    cfg, tracker, prep = job.cfg, job.tracker, job.inputs

    from speclab.raylib import init_ray

    storage, run_name = run_dirs(cfg)
    data_dir = storage / run_name / "data"
    where = init_ray(job.address, cfg.ray.num_cpus)
    print(f"[compare_eagle] running on {where}; run dir {storage / run_name}", flush=True)
    losses, finetune = cfg.compare.losses, cfg.compare.finetune_steps
    table: list[dict] = []
    with tracker as parent:
        parent.set_tags({"job": "compare_eagle", "target": prep.target})
        generate_features(cfg, prep, data_dir, parent, ["eagle", *losses] if finetune
                          else losses)
        init_from = cfg.eagle.init_from
        if finetune:
            base = cfg.model_copy(update={"eagle": cfg.eagle.model_copy(
                update={"loss": "eagle"})})
            print("[compare_eagle] === eagle base ===", flush=True)
            with parent.child(f"{cfg.name}-base", base.model_dump(mode="json")) as child:
                child.set_tags({"loss": "eagle", "stage": "base"})
                init_from, _ = train_register_evaluate_eagle(
                    base, prep, storage, f"{run_name}-base", data_dir, child, None,
                    evaluate=False)
        for loss in losses:
            train = cfg.train.model_copy(update={"steps": finetune}) if finetune else cfg.train
            sub = cfg.model_copy(update={
                "train": train,
                "eagle": cfg.eagle.model_copy(update={"loss": loss, "init_from": (
                    str(init_from) if init_from else None)})})
            register = f"{cfg.output.register_as}-{loss}" if cfg.output.register_as else None
            print(f"[compare_eagle] === {loss} ===", flush=True)
            with parent.child(f"{cfg.name}-{loss}", sub.model_dump(mode="json")) as child:
                child.set_tags({"loss": loss})
                _, rows = train_register_evaluate_eagle(sub, prep, storage,
                                                        f"{run_name}-{loss}", data_dir,
                                                        child, register)
            table += comparison_rows(loss, rows)  # methods keep their configured names
        log_comparison(parent, table)
    return 0

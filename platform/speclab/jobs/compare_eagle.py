"""Compare EAGLE-family drafters: the SALF & TALF paper's Table 2 shape on EAGLE drafters
(row ``eagle`` / ``hass`` / ``talf`` / ``eagle3`` / ``eagle3_talf`` x tree method -> tau,
speedup, acceptance per draft position).

    python -m jobs.compare_eagle --config experiments/compare_eagle.yaml [key=value ...]

The target's ``feat`` (and, for ``talf``, ``feat_tree``; for EAGLE-3 rows the fused
``feat3`` / ``feat3_tree``) shards are generated once into a shared folder. With
``compare.finetune_steps`` 0 every row in ``compare.losses`` trains a drafter from scratch
for ``train.steps``; with ``finetune_steps`` > 0 a base drafter per version (EAGLE loss,
EAGLE-3 loss) trains for ``train.steps`` first and every row then continues from its
version's base for ``finetune_steps`` (the paper trains HASS and TALF on top of an
EAGLE-trained drafter; here the ``eagle`` and ``eagle3`` rows get the same extra steps, so
budgets are equal). EAGLE-3 rows take ``compare.eagle3``'s settings. Each drafter is
registered (``output.register_as``-<loss>) and evaluated with every method in ``methods``
(``eagle`` methods use it). Each loss is an MLflow child run of the comparison's parent
run, which gets the table (``loss_comparison.csv/json/txt``), tau per loss and method,
and acceptance per draft position (``acceptance_per_position.png``: EAGLE vs HASS vs TALF,
the HASS slide's figure).
"""

from __future__ import annotations

from speclab.families.eagle.stages import (
    data_kind_of,
    generate_features,
    prepare_eagle,
    train_register_evaluate_eagle,
)
from speclab.models.loading import resolve_source
from speclab.pipelines.cli import run_dirs, start_job
from speclab.pipelines.comparison import comparison_rows, log_comparison
from speclab.raylib import init_ray


def main(argv: list[str] | None = None) -> int:
    job = start_job("compare_eagle", __doc__, argv, prepare_eagle)
    cfg, tracker, prep = job.cfg, job.tracker, job.inputs

    storage, run_name = run_dirs(cfg)
    data_dir = storage / run_name / "data"
    where = init_ray(job.address, cfg.ray.num_cpus)
    print(f"[compare_eagle] running on {where}; run dir {storage / run_name}", flush=True)
    rows, finetune = cfg.compare.losses, cfg.compare.finetune_steps
    eagles = {row: cfg.compare.row_eagle(row, cfg.eagle) for row in rows}
    versions = sorted({e.version for e in eagles.values()})
    base_loss = {1: "eagle", 3: "eagle3"}  # the base drafter of each version
    table: list[dict] = []
    with tracker as parent:
        parent.set_tags({"job": "compare_eagle", "target": prep.target})
        group = {data_kind_of(e.loss, e.version): e for e in eagles.values()}
        if finetune:  # a version's base reads data made with that version's rows' settings
            group |= {data_kind_of(base_loss[e.version], e.version): e
                      for e in eagles.values()}
        # each kind made with its rows' eagle group: EAGLE-3's layers (compare.eagle3)
        generate_features(cfg, prep, data_dir, parent, set(group), group)
        init_from = {v: cfg.eagle.init_from for v in versions}
        for v in versions if finetune else []:
            name = base_loss[v]
            if name in cfg.compare.bases:  # a trained base given: checked by prepare_eagle
                init_from[v] = resolve_source(cfg.compare.bases[name], f"compare.bases.{name}")
                print(f"[compare_eagle] {name} base: {init_from[v]}", flush=True)
                continue
            base = cfg.model_copy(update={"eagle": cfg.compare.row_eagle(name, cfg.eagle)})
            print(f"[compare_eagle] === {name} base ===", flush=True)
            with parent.child(f"{cfg.name}-base-{name}", base.model_dump(mode="json")) as child:
                child.set_tags({"loss": name, "stage": "base"})
                init_from[v], _ = train_register_evaluate_eagle(
                    base, prep, storage, f"{run_name}-base-{name}", data_dir, child, None,
                    evaluate=False)
        for row in rows:
            e = eagles[row]
            train = cfg.train.model_copy(update={"steps": finetune}) if finetune else cfg.train
            start = init_from[e.version]
            sub = cfg.model_copy(update={"train": train, "eagle": cfg.compare.row_eagle(
                row, cfg.eagle, init_from=str(start) if start else None)})
            register = f"{cfg.output.register_as}-{row}" if cfg.output.register_as else None
            print(f"[compare_eagle] === {row} ===", flush=True)
            with parent.child(f"{cfg.name}-{row}", sub.model_dump(mode="json")) as child:
                child.set_tags({"loss": row})
                _, got = train_register_evaluate_eagle(sub, prep, storage, f"{run_name}-{row}",
                                                       data_dir, child, register)
            table += comparison_rows(row, got)  # methods keep their configured names
        log_comparison(parent, table)
    return 0

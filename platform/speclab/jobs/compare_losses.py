"""Compare drafter losses: the TALF paper's Table 2 shape (tree method x loss -> tau, speedup).

    python -m jobs.compare_losses --config experiments/distill_compare.yaml [key=value ...]

The target's signals for every loss in ``compare.losses`` are generated once into a
shared folder; then one drafter per loss is trained with the same architecture, data
and budget (``arch``, ``train``), registered (``output.register_as``-<loss>) and
evaluated with every method in ``methods``. Each loss is an MLflow child run of the
comparison's parent run, which gets the table (``loss_comparison.csv/json/txt``), a
plot of tau per method and loss and one of acceptance per draft position
(:mod:`speclab.pipelines.comparison`).
"""

from __future__ import annotations

from speclab.losses import loss_data_kinds
from speclab.pipelines.cli import run_dirs, start_job
from speclab.pipelines.comparison import comparison_rows, log_comparison
from speclab.pipelines.drafter import prepare_drafter, train_register_evaluate
from speclab.pipelines.signals import generate_logged
from speclab.raylib import init_ray


def main(argv: list[str] | None = None) -> int:
    job = start_job("compare_losses", __doc__, argv, prepare_drafter)
    cfg, tracker, prep = job.cfg, job.tracker, job.inputs

    storage, run_name = run_dirs(cfg)
    data_dir = storage / run_name / "data"
    where = init_ray(job.address, cfg.ray.num_cpus)
    print(f"[compare_losses] running on {where}; run dir {storage / run_name}", flush=True)
    table: list[dict] = []
    with tracker as parent:
        parent.set_tags({"job": "compare_losses", "target": prep.target})
        generate_logged(cfg, prep, data_dir, parent,
                        loss_data_kinds(cfg.compare.losses), "compare_losses")
        for loss in cfg.compare.losses:
            sub = cfg.model_copy(update={"distill": cfg.distill.model_copy(update={"loss": loss})})
            register = f"{cfg.output.register_as}-{loss}" if cfg.output.register_as else None
            print(f"[compare_losses] === {loss} ===", flush=True)
            with parent.child(f"{cfg.name}-{loss}", sub.model_dump(mode="json")) as child:
                child.set_tags({"loss": loss})
                rows = train_register_evaluate(sub, prep, storage, f"{run_name}-{loss}",
                                               data_dir, child, register, {loss: 1.0})
            table += comparison_rows(loss, rows)
        log_comparison(parent, table)
    return 0

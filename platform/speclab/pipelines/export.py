"""Stage: a training job's final drafter exported to the public formats of
``output.export`` (:func:`speclab.models.formats.export_drafter`), each folder logged as an
MLflow artifact of the run (``export/<format>``)."""

from __future__ import annotations

from pathlib import Path


def export_final(formats: list[str], folder: str | Path, target: str, tracker,
                 job: str) -> list[Path]:
    """Write the drafter in ``folder`` in each of ``formats`` to ``<folder>-<format>``
    (``target``: the target's name or folder, the verifier vLLM loads / Medusa's base
    model) and log each as an artifact of ``tracker``'s run. Returns the folders."""
    from speclab.models.formats import export_drafter

    outs = []
    for fmt in formats:
        out = export_drafter(folder, fmt, Path(folder).with_name(f"{Path(folder).name}-{fmt}"),
                             target=target)
        log_folder(tracker, out, f"export/{fmt}")
        print(f"[{job}] exported the drafter to {out} ({fmt})", flush=True)
        outs.append(out)
    return outs


def log_folder(tracker, folder: Path, artifact_path: str) -> None:
    """``folder``'s files as artifacts under ``artifact_path`` of ``tracker``'s run
    (nothing for the no-op tracker). Uses the tracker's ``log_artifacts`` when it has one,
    else MLflow's through the tracker's retrying call."""
    log = getattr(tracker, "log_artifacts", None)
    if callable(log):
        log(str(folder), artifact_path)
        return
    mlflow = getattr(tracker, "mlflow", None)
    if mlflow is None or not getattr(tracker, "run_id", None):
        return
    # MlflowTracker has no folder-artifact method yet: its retried call, as log_table does
    tracker._call(f"logging {artifact_path}", mlflow.log_artifacts, str(folder),
                  artifact_path)

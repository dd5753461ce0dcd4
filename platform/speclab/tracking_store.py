"""Where the MLflow store is, and registered models fetched from it, below everything
that tracks (:mod:`speclab.tracking`) and the model loader (:mod:`speclab.models.loading`),
which downloads ``models:/`` URIs through :func:`resolve_model_uri`. MLflow is imported
only when a model is downloaded.

Store resolution: ``tracking.uri`` in the config > ``$MLFLOW_TRACKING_URI`` > the
embedded store ``sqlite:///$SPECLAB_HOME/mlflow.db`` with artifacts in
``$SPECLAB_HOME/mlartifacts`` (no server needed).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

from speclab.paths import speclab_home


def default_tracking_uri() -> str:
    """The embedded SQLite store under ``$SPECLAB_HOME``."""
    return f"sqlite:///{speclab_home() / 'mlflow.db'}"


def default_artifact_root() -> str:
    """Where the embedded store keeps artifacts (a ``file://`` URI)."""
    path = speclab_home() / "mlartifacts"
    path.mkdir(parents=True, exist_ok=True)
    return path.as_uri()


def resolve_tracking_uri(configured: str | None = None) -> str:
    """Config > ``$MLFLOW_TRACKING_URI`` > embedded SQLite."""
    return configured or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()


#: ``(store, uri) -> HF folder`` of this process's downloads (each downloaded once)
_DOWNLOADS: dict[tuple[str, str], str] = {}
#: the download folders this process made, removed when it exits
_FOLDERS: list[Path] = []


def _remove_downloads() -> None:
    for folder in _FOLDERS:
        shutil.rmtree(folder, ignore_errors=True)


def resolve_model_uri(uri: str, tracking_uri: str | None = None) -> str:
    """Download ``models:/name/version`` (or ``runs:/...``) and return the HF folder in it.
    One download per store and URI in a process, into a temporary folder that lives as
    long as the process (removed at its exit: the models it loaded are in memory)."""
    import mlflow

    store = resolve_tracking_uri(tracking_uri)
    known = _DOWNLOADS.get((store, uri))
    if known is not None and Path(known).is_dir():
        return known
    mlflow.set_tracking_uri(store)
    target = Path(tempfile.mkdtemp(prefix="speclab-model-")).resolve()
    if not _FOLDERS:
        atexit.register(_remove_downloads)
    _FOLDERS.append(target)
    try:
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri,
                                                         dst_path=str(target)))
    except Exception as exc:  # MLflow raises several types for a missing model
        shutil.rmtree(target, ignore_errors=True)
        raise ValueError(f"model: cannot resolve {uri!r} in the MLflow registry: {exc}") from None
    try:
        check_inside(target, local)
    except ValueError as exc:
        shutil.rmtree(target, ignore_errors=True)
        raise ValueError(f"model: {uri!r}: {exc}") from None
    configs = sorted(local.rglob("config.json"), key=lambda p: len(p.parts))
    if not configs:
        shutil.rmtree(target, ignore_errors=True)
        raise ValueError(f"model: {uri!r} holds no saved HF model (no config.json)")
    _DOWNLOADS[(store, uri)] = str(configs[0].parent)
    return _DOWNLOADS[(store, uri)]


def check_inside(folder: Path, path: Path) -> None:
    """ValueError unless ``path`` and everything under it (symlinks resolved) lie inside
    ``folder``: a downloaded artifact may not point or write anywhere else."""
    root = folder.resolve()
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        real = p.resolve()
        if real != root and root not in real.parents:
            raise ValueError(f"{p} resolves to {real}, outside the download folder {root}")

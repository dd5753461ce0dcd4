"""Where speclab keeps things on this machine: ``$SPECLAB_HOME`` (default ``~/.speclab``).

``models/`` caches built models, ``mlflow.db`` + ``mlartifacts/`` are the embedded MLflow
store, ``ray/`` holds Ray session files of embedded runs, ``runs/`` job outputs.
"""

from __future__ import annotations

import os
from pathlib import Path


def speclab_home() -> Path:
    """The root folder (created on first use)."""
    home = Path(os.environ.get("SPECLAB_HOME", "~/.speclab")).expanduser().resolve()
    home.mkdir(parents=True, exist_ok=True)
    return home


def repo_root() -> Path:
    """The checkout this package lives in (``platform/speclab`` -> repo)."""
    return Path(__file__).resolve().parents[2]

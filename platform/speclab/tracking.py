"""MLflow behind one small interface (and a null tracker for tests / tracking off).

Store resolution: ``tracking.uri`` in the config > ``$MLFLOW_TRACKING_URI`` > the
embedded store ``sqlite:///$SPECLAB_HOME/mlflow.db`` with artifacts in
``$SPECLAB_HOME/mlartifacts`` (no server needed). A remote server is probed before any
expensive work so an unreachable one is reported at once, naming the URI.

Every run gets: flattened params, metrics (with steps), the resolved config YAML, tags
``git_commit`` and ``config_hash``; jobs add tables (CSV/JSON) and plots (PNG).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from speclab.paths import repo_root, speclab_home


class TrackingUnavailable(RuntimeError):
    """The configured tracking server cannot be reached."""


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


def check_reachable(uri: str, timeout: float = 5.0) -> None:
    """Raise :class:`TrackingUnavailable` if an http(s) tracking server does not answer."""
    if not uri.startswith(("http://", "https://")):
        return
    import requests

    url = uri.rstrip("/") + "/api/2.0/mlflow/experiments/search"
    try:
        resp = requests.post(url, json={"max_results": 1}, timeout=timeout)
    except requests.RequestException as exc:
        raise TrackingUnavailable(
            f"tracking.uri: MLflow server {uri} is unreachable ({type(exc).__name__}); "
            "start it, fix tracking.uri / MLFLOW_TRACKING_URI, or unset it for the "
            "embedded store"
        ) from None
    if resp.status_code >= 500 or resp.status_code == 404:
        raise TrackingUnavailable(
            f"tracking.uri: {uri} answered HTTP {resp.status_code}; is it an MLflow server?"
        )


def flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}, "l": [{"x": 2}]}`` -> ``{"a.b": 1, "l.0.x": 2}``."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for i, item in enumerate(value):
                out.update(flatten(item, f"{name}.{i}."))
        else:
            out[name] = value
    return out


def config_hash(config: dict) -> str:
    """Short stable hash of a resolved config."""
    return hashlib.sha1(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:12]


def git_commit() -> str:
    """The checkout's commit (``SPECLAB_GIT_COMMIT`` when shipped without .git)."""
    env = os.environ.get("SPECLAB_GIT_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo_root(), capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def metric_key(name: str) -> str:
    """Make a string a valid MLflow metric/param key (letters, digits, _-./ and spaces)."""
    return "".join(ch if ch.isalnum() or ch in "_-./ " else "_" for ch in name).strip("_")


class NullTracker:
    """Does nothing; same interface as :class:`MlflowTracker`."""

    run_id: str | None = None
    uri: str | None = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def log_params(self, params: dict) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...

    def log_text(self, text: str, name: str) -> None: ...

    def log_table(self, rows: list[dict], name: str) -> None: ...

    def log_figure(self, fig, name: str) -> None: ...

    def set_tags(self, tags: dict[str, str]) -> None: ...

    def log_model(self, folder: str | Path, registered_name: str | None) -> str | None:
        return None

    def child(self, run_name: str, config: dict) -> NullTracker:
        """A nested run (a trial, one loss of a comparison); no-op here."""
        return NullTracker()


class MlflowTracker(NullTracker):
    """One MLflow run: ``with MlflowTracker(uri, experiment, run_name, config) as t: ...``."""

    def __init__(self, uri: str, experiment: str, run_name: str | None, config: dict,
                 nested: bool = False) -> None:
        import mlflow

        self.mlflow = mlflow
        self.uri = uri
        self.experiment = experiment
        self.nested = nested
        mlflow.set_tracking_uri(uri)
        if mlflow.get_experiment_by_name(experiment) is None:
            embedded = uri.startswith("sqlite:")
            mlflow.create_experiment(
                experiment, artifact_location=default_artifact_root() + f"/{experiment}"
                if embedded else None)
        mlflow.set_experiment(experiment)
        self.run_name = run_name
        self.config = config

    def __enter__(self):
        run = self.mlflow.start_run(run_name=self.run_name, nested=self.nested)
        self.run_id = run.info.run_id
        self.set_tags({"git_commit": git_commit(), "config_hash": config_hash(self.config)})
        self.log_params(flatten(self.config))
        import yaml

        self.log_text(yaml.safe_dump(self.config, sort_keys=False), "config.yaml")
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.mlflow.end_run(status="FAILED" if exc_type else "FINISHED")

    def set_tags(self, tags: dict[str, str]) -> None:
        self.mlflow.set_tags(tags)

    def log_params(self, params: dict) -> None:
        clean = {metric_key(k): ("" if v is None else str(v))[:6000] for k, v in params.items()}
        items = list(clean.items())
        for i in range(0, len(items), 100):  # MLflow batches at most 100 params
            self.mlflow.log_params(dict(items[i : i + 100]))

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        clean = {metric_key(k): float(v) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self.mlflow.log_metrics(clean, step=step)

    def log_text(self, text: str, name: str) -> None:
        self.mlflow.log_text(text, name)

    def log_table(self, rows: list[dict], name: str) -> None:
        """Write ``rows`` as ``<name>.csv`` and ``<name>.json`` artifacts."""
        import pandas as pd

        with tempfile.TemporaryDirectory() as tmp:
            pd.DataFrame(rows).to_csv(Path(tmp) / f"{name}.csv", index=False)
            (Path(tmp) / f"{name}.json").write_text(json.dumps(rows, indent=2, default=str))
            self.mlflow.log_artifacts(tmp)

    def log_figure(self, fig, name: str) -> None:
        self.mlflow.log_figure(fig, name)

    def log_model(self, folder: str | Path, registered_name: str | None) -> str | None:
        """Log a saved HF folder as this run's model; register it when named."""
        return log_hf_model(folder, registered_name)

    def child(self, run_name: str, config: dict) -> MlflowTracker:
        """A nested run under the active one (use inside this run's ``with``)."""
        return MlflowTracker(self.uri, self.experiment, run_name, config, nested=True)


def open_tracker(enabled: bool, uri: str | None, experiment: str, run_name: str | None,
                 config: dict) -> NullTracker:
    """A tracker for a job; checks a remote server first (before expensive work)."""
    if not enabled:
        return NullTracker()
    resolved = resolve_tracking_uri(uri)
    check_reachable(resolved)
    return MlflowTracker(resolved, experiment, run_name, config)


MODEL_URI_PREFIXES = ("models:/", "runs:/")


def _hf_pyfunc_class():
    import mlflow.pyfunc

    class HFCausalLM(mlflow.pyfunc.PythonModel):
        """A saved HF causal LM (+ tokenizer) as an MLflow pyfunc: greedy completion."""

        def load_context(self, context) -> None:
            from speclab.api import Decoder

            self.decoder = Decoder.from_pretrained(context.artifacts["hf"])

        def predict(self, context, model_input, params=None):
            params = params or {}
            prompts = list(model_input["prompt"])
            return [self.decoder.generate(p, method="ar",
                                          max_new_tokens=int(params.get("max_new_tokens", 32))
                                          ).text for p in prompts]

    return HFCausalLM


def log_hf_model(folder: str | Path, registered_name: str | None) -> str | None:
    """Log a ``save_pretrained`` folder to the ACTIVE run as an MLflow model (pyfunc with
    the folder as artifact ``hf``) and register it; returns ``models:/name/version``."""
    import mlflow

    info = mlflow.pyfunc.log_model(
        name="model", python_model=_hf_pyfunc_class()(), artifacts={"hf": str(folder)},
        registered_model_name=registered_name, pip_requirements=["torch", "transformers"],
    )
    if not registered_name:
        return None
    version = getattr(info, "registered_model_version", None)
    if version is None:
        from mlflow.tracking import MlflowClient

        versions = MlflowClient().search_model_versions(f"name='{registered_name}'")
        version = max(int(v.version) for v in versions)
    return f"models:/{registered_name}/{version}"


def resolve_model_uri(uri: str, tracking_uri: str | None = None) -> str:
    """Download ``models:/name/version`` (or ``runs:/...``) and return the HF folder in it."""
    import mlflow

    mlflow.set_tracking_uri(resolve_tracking_uri(tracking_uri))
    try:
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri))
    except Exception as exc:  # MLflow raises several types for a missing model
        raise ValueError(f"model: cannot resolve {uri!r} in the MLflow registry: {exc}") from None
    configs = sorted(local.rglob("config.json"), key=lambda p: len(p.parts))
    if not configs:
        raise ValueError(f"model: {uri!r} holds no saved HF model (no config.json)")
    return str(configs[0].parent)

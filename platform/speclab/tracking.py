"""MLflow behind one small interface (and a null tracker for tests / tracking off).

Store resolution (:mod:`speclab.tracking_store`, re-exported here): ``tracking.uri`` in
the config > ``$MLFLOW_TRACKING_URI`` > the embedded store
``sqlite:///$SPECLAB_HOME/mlflow.db`` with artifacts in ``$SPECLAB_HOME/mlartifacts``
(no server needed). A remote server is probed before any
expensive work so an unreachable one is reported at once, naming the URI.

Every run gets: flattened params, metrics (with steps), the resolved config YAML, tags
``git_commit`` and ``config_hash``; jobs add tables (CSV/JSON) and plots (PNG).

Outages: the driver's calls retry while the server does not answer, for up to
``$SPECLAB_TRACKING_FLUSH_TIMEOUT_S`` (default 120 s) each, then raise
:class:`TrackingUnavailable`; in this process MLflow's own HTTP retries are shortened
(``MLFLOW_HTTP_REQUEST_*``, unless set) so one attempt fails in seconds. A run ends
FINISHED only when the job succeeded and every metric reached the server; otherwise it
is marked FAILED, or stays RUNNING when the server cannot even be told that. Training
workers buffer their per-step metrics instead (:mod:`speclab.tracking_buffer`).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from speclab.paths import repo_root
from speclab.tracking_buffer import FLUSH_TIMEOUT_ENV, flush_timeout_s, is_transient, short_error
from speclab.tracking_store import check_inside as check_inside
from speclab.tracking_store import default_artifact_root as default_artifact_root
from speclab.tracking_store import default_tracking_uri as default_tracking_uri
from speclab.tracking_store import resolve_model_uri as resolve_model_uri
from speclab.tracking_store import resolve_tracking_uri as resolve_tracking_uri

#: MLflow 3's experiment tag choosing the experiment page's layout: with
#: ``custom_model_development`` it opens on the runs table (params, metrics, charts),
#: not on the GenAI traces view
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"


class TrackingUnavailable(RuntimeError):
    """The configured tracking server cannot be reached."""


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


def launch_tags() -> dict[str, str]:
    """How this run was started: ``command`` (this process's command line) and, under
    Ray Jobs, ``ray_job_id`` (the submission id ``ray job submit`` / ``speclab submit``
    printed), so two submissions of one config are told apart."""
    tags = {"command": " ".join(["python", *sys.argv])[:5000]}
    try:
        meta = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")).get("metadata")
    except ValueError:
        meta = None
    job = (meta or {}).get("job_submission_id")
    if job:
        tags["ray_job_id"] = str(job)
    return tags


def metric_key(name: str) -> str:
    """Make a string a valid MLflow metric/param key (letters, digits, _-./ and spaces)."""
    return "".join(ch if ch.isalnum() or ch in "_-./ " else "_" for ch in name).strip("_")


class Tracker(Protocol):
    """What a job tracks through: :class:`MlflowTracker` (one MLflow run) and
    :class:`NullTracker` (nothing) both satisfy it. Use it as a context manager;
    ``run_id`` / ``experiment_id`` are None until the run starts (always, untracked)."""

    run_id: str | None
    experiment_id: str | None
    uri: str | None

    def __enter__(self) -> Tracker: ...

    def __exit__(self, *exc) -> None: ...

    def log_params(self, params: dict) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...

    def log_series(self, key: str, values: dict[int, float]) -> None:
        """Metric ``key`` at each step of ``values`` (``{step: value}``), in one call."""

    def log_text(self, text: str, name: str) -> None: ...

    def log_table(self, rows: list[dict], name: str) -> None: ...

    def log_figure(self, fig, name: str) -> None: ...

    def log_dataset(self, rows: list[dict], name: str, context: str) -> None:
        """``rows`` as the run's dataset input ``name`` (MLflow's Datasets column)."""

    def set_tags(self, tags: dict[str, str]) -> None: ...

    def log_model(self, folder: str | Path, registered_name: str | None) -> str | None: ...

    def child(self, run_name: str, config: dict) -> Tracker:
        """A nested run (a trial, one loss of a comparison)."""

    def set_duration(self, seconds: float) -> None:
        """After the run ended: its end time set ``seconds`` after its start (a method's
        run, logged after the paired timing, then shows the method's decoding time)."""


class NullTracker:
    """Does nothing: a :class:`Tracker` for tests and for tracking off."""

    run_id: str | None = None
    experiment_id: str | None = None
    uri: str | None = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def log_params(self, params: dict) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...

    def log_series(self, key: str, values: dict[int, float]) -> None:
        """Metric ``key`` at each step of ``values`` (``{step: value}``), in one call."""

    def log_text(self, text: str, name: str) -> None: ...

    def log_table(self, rows: list[dict], name: str) -> None: ...

    def log_figure(self, fig, name: str) -> None: ...

    def log_dataset(self, rows: list[dict], name: str, context: str) -> None:
        """``rows`` as the run's dataset input ``name``; no-op here."""

    def set_tags(self, tags: dict[str, str]) -> None: ...

    def log_model(self, folder: str | Path, registered_name: str | None) -> str | None:
        return None

    def child(self, run_name: str, config: dict) -> NullTracker:
        """A nested run (a trial, one loss of a comparison); no-op here."""
        return NullTracker()

    def set_duration(self, seconds: float) -> None: ...


class MlflowTracker:
    """One MLflow run, a :class:`Tracker`:
    ``with MlflowTracker(uri, experiment, run_name, config) as t: ...``.

    Every call to the server is retried for up to ``retry_s`` seconds (default
    ``$SPECLAB_TRACKING_FLUSH_TIMEOUT_S``, 120) while the server does not answer; then
    :class:`TrackingUnavailable` is raised. Leaving the ``with`` block ends the run
    FINISHED only if the body succeeded and the server confirms it; otherwise FAILED if
    the server can be told, else the run stays RUNNING (never FINISHED).
    """

    run_id: str | None = None
    experiment_id: str | None = None

    def __init__(self, uri: str, experiment: str, run_name: str | None, config: dict,
                 nested: bool = False, retry_s: float | None = None) -> None:
        import mlflow

        self.mlflow = mlflow
        self.uri = uri
        self.experiment = experiment
        self.nested = nested
        self.retry_s = flush_timeout_s() if retry_s is None else float(retry_s)
        if uri.startswith(("http://", "https://")):
            _bounded_mlflow_http()
        mlflow.set_tracking_uri(uri)
        if self._call("looking up the experiment", mlflow.get_experiment_by_name,
                      experiment) is None:
            embedded = uri.startswith("sqlite:")
            try:
                self._call("creating the experiment", mlflow.create_experiment, experiment,
                           artifact_location=default_artifact_root() + f"/{experiment}"
                           if embedded else None)
            except Exception as exc:  # created meanwhile (another job, a retried request)
                if self._call("looking up the experiment", mlflow.get_experiment_by_name,
                              experiment) is None:
                    raise exc from None
        exp = self._call("setting the experiment", mlflow.set_experiment, experiment)
        if EXPERIMENT_KIND_TAG not in (exp.tags or {}):  # open its page on the runs table
            self._call("tagging the experiment", mlflow.set_experiment_tag,
                       EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        self.run_name = run_name
        self.config = config

    def _call(self, what: str, fn: Callable[..., Any], *args: Any,
              budget: float | None = None, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, retried with a backoff (1 s doubling to 10 s) for up
        to ``budget`` s (default ``retry_s``) while the server does not answer; raises
        :class:`TrackingUnavailable` naming the server and ``what`` when it never does.
        Other errors (a rejected value, say) are raised at once."""
        budget = self.retry_s if budget is None else budget
        start = time.monotonic()
        delay, failures = 1.0, 0
        while True:
            try:
                result = fn(*args, **kwargs)
            except Exception as exc:
                if not is_transient(exc):
                    raise
                failures += 1
                waited = time.monotonic() - start
                if waited >= budget:
                    raise TrackingUnavailable(
                        f"MLflow tracking server {self.uri} unreachable for {waited:.0f} s "
                        f"(budget {budget:.0f} s, ${FLUSH_TIMEOUT_ENV}) while {what}"
                        + (f" (run {self.run_id})" if self.run_id else "")
                        + f": {short_error(exc, 200)}") from None
                if failures == 1:
                    print(f"[tracking] MLflow server {self.uri} unreachable while {what} "
                          f"({short_error(exc, 120)}); retrying for up to {budget:.0f} s",
                          file=sys.stderr, flush=True)
                time.sleep(max(0.0, min(delay, budget - waited)))
                delay = min(delay * 2, 10.0)
                continue
            if failures:
                print(f"[tracking] MLflow server {self.uri} answers again after "
                      f"{time.monotonic() - start:.1f} s ({what})", file=sys.stderr, flush=True)
            return result

    def __enter__(self):
        run = self._call("starting the run", self.mlflow.start_run, run_name=self.run_name,
                         nested=self.nested)
        self.run_id, self.experiment_id = run.info.run_id, run.info.experiment_id
        try:
            self.set_tags({"git_commit": git_commit(), "config_hash": config_hash(self.config),
                           **({} if self.nested else launch_tags())})
            self.log_params(flatten(self.config))
            import yaml

            self.log_text(yaml.safe_dump(self.config, sort_keys=False), "config.yaml")
        except BaseException as exc:  # end it here: MLflow's exit hook would say FINISHED
            self.__exit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        status = "FAILED" if exc_type else "FINISHED"
        # after giving up on the server once, do not wait the whole budget again
        budget = min(self.retry_s, 10.0) if exc_type is not None and issubclass(
            exc_type, TrackingUnavailable) else self.retry_s
        active = self.mlflow.active_run()
        if active is not None and active.info.run_id == self.run_id:
            try:  # pops this run (so MLflow's atexit hook never ends it), then tells the
                self.mlflow.end_run(status=status)  # server
                return None
            except Exception as first:
                if not is_transient(first):
                    raise
        # not on top of MLflow's run stack (or the server did not answer): end it by id
        from mlflow.tracking import MlflowClient

        try:
            self._call(f"ending the run as {status}", MlflowClient(self.uri).set_terminated,
                       self.run_id, status, budget=budget)
        except TrackingUnavailable as gone:
            if exc_type is None:
                raise TrackingUnavailable(f"{gone}; the run stays RUNNING (not FINISHED)") \
                    from None
            print(f"[tracking] {gone}; the run stays RUNNING", file=sys.stderr, flush=True)
        return None

    def set_tags(self, tags: dict[str, str]) -> None:
        self._call("setting tags", self.mlflow.set_tags, tags)

    def log_params(self, params: dict) -> None:
        clean = {metric_key(k): ("" if v is None else str(v))[:6000] for k, v in params.items()}
        items = list(clean.items())
        for i in range(0, len(items), 100):  # MLflow batches at most 100 params
            self._call("logging params", self.mlflow.log_params, dict(items[i : i + 100]))

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        clean = {metric_key(k): float(v) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool)}
        # one timestamp for all attempts: a retried batch that did arrive is not doubled
        self._call("logging metrics", self.mlflow.log_metrics, clean, step=step,
                   timestamp=int(time.time() * 1000))

    def log_series(self, key: str, values: dict[int, float]) -> None:
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        now = int(time.time() * 1000)  # one timestamp: a retried batch is not doubled
        batch = [Metric(metric_key(key), float(v), now, int(step))
                 for step, v in values.items()]
        self._call(f"logging {key}", MlflowClient(self.uri).log_batch, self.run_id,
                   metrics=batch)

    def log_text(self, text: str, name: str) -> None:
        self._call(f"logging {name}", self.mlflow.log_text, text, name)

    def log_table(self, rows: list[dict], name: str) -> None:
        """Write ``rows`` as ``<name>.csv`` and ``<name>.json`` artifacts."""
        import pandas as pd

        with tempfile.TemporaryDirectory() as tmp:
            pd.DataFrame(rows).to_csv(Path(tmp) / f"{name}.csv", index=False)
            (Path(tmp) / f"{name}.json").write_text(json.dumps(rows, indent=2, default=str))
            self._call(f"logging table {name}", self.mlflow.log_artifacts, tmp)

    def log_figure(self, fig, name: str) -> None:
        self._call(f"logging figure {name}", self.mlflow.log_figure, fig, name)

    def log_dataset(self, rows: list[dict], name: str, context: str) -> None:
        """``rows`` (a pandas frame's records) as the run's dataset input ``name`` with
        ``context`` (``evaluation``): the runs page's Datasets column shows it."""
        import pandas as pd

        data = self.mlflow.data.from_pandas(pd.DataFrame(rows), name=name)
        self._call(f"logging dataset {name}", self.mlflow.log_input, data, context=context)

    def log_model(self, folder: str | Path, registered_name: str | None) -> str | None:
        """Log a saved HF folder as this run's model; register it when named (retried
        while the server does not answer; a retry after a partial upload may leave an
        unfinished logged model beside the complete one)."""
        return self._call("logging the model", log_hf_model, folder, registered_name)

    def child(self, run_name: str, config: dict) -> MlflowTracker:
        """A nested run under the active one (use inside this run's ``with``)."""
        return MlflowTracker(self.uri, self.experiment, run_name, config, nested=True,
                             retry_s=self.retry_s)

    def set_duration(self, seconds: float) -> None:
        """After the run ended: its end time set ``seconds`` after its start."""
        from mlflow.tracking import MlflowClient

        client = MlflowClient(self.uri)
        run = self._call("reading the run", client.get_run, self.run_id)
        self._call("setting the run's end time", client.set_terminated, self.run_id,
                   run.info.status, run.info.start_time + max(int(seconds * 1000), 1))


def _bounded_mlflow_http() -> None:
    """Make one MLflow HTTP call of this process fail within seconds, not minutes, when
    the server is down (2 retries, backoff factor 1), unless the user set
    ``MLFLOW_HTTP_REQUEST_*`` already; :meth:`MlflowTracker._call` retries on top. The
    request timeout stays MLflow's own (120 s): a large model upload is one request."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")


def open_tracker(enabled: bool, uri: str | None, experiment: str, run_name: str | None,
                 config: dict) -> Tracker:
    """A tracker for a job; checks a remote server first (before expensive work)."""
    if not enabled:
        return NullTracker()
    resolved = resolve_tracking_uri(uri)
    check_reachable(resolved)
    return MlflowTracker(resolved, experiment, run_name, config)


def ui_record() -> Path:
    """Where a running ``speclab ui`` records its port, pid and store."""
    from speclab.paths import speclab_home

    return speclab_home() / "ui.json"


def running_ui_port(uri: str) -> int | None:
    """The port of a ``speclab ui`` running now over the store ``uri`` (its record, with
    a live pid); None when there is none."""
    try:
        rec = json.loads(ui_record().read_text())
        os.kill(int(rec["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return int(rec["port"]) if rec.get("uri") == str(uri) else None


def run_link(tracker: Tracker, ui_port: int | None = None) -> str | None:
    """The browser address of ``tracker``'s run: on its tracking server, or on the UI
    that ``speclab ui`` serves over a local store (``ui_port``; default: the port of the
    one running now, else 5000, its default); None untracked."""
    if not tracker.run_id or not tracker.experiment_id:
        return None
    uri = str(tracker.uri or "")
    port = ui_port or running_ui_port(uri) or 5000
    base = uri.rstrip("/") if uri.startswith(("http://", "https://")) else \
        f"http://127.0.0.1:{port}"
    return (f"{base}/#/experiments/{tracker.experiment_id}/runs/{tracker.run_id}"
            "?workflowType=machine_learning")


MODEL_URI_PREFIXES = ("models:/", "runs:/")


def _hf_pyfunc_class():
    import mlflow.pyfunc

    class HFCausalLM(mlflow.pyfunc.PythonModel):
        """A saved HF causal LM (+ tokenizer) as an MLflow pyfunc: greedy completion."""

        def load_context(self, context) -> None:
            # lazy: the engine (torch, transformers) only where a logged model is loaded,
            # not in every process that tracks
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

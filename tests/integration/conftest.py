"""Integration helpers: isolated SPECLAB_HOME / MLflow store, free ports, subprocess jobs,
and stopping exactly the processes a test started (never by name)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from speclab.proctree import ProcessTree as _Tree  # noqa: F401  (the tests' name)
from speclab.proctree import stop_process_tree  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening_addresses(port: int) -> set[str]:
    """The local addresses on which some process listens on TCP ``port``."""
    import psutil

    return {c.laddr.ip for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


@pytest.fixture
def job_env(tmp_path) -> dict[str, str]:
    """Environment for a job subprocess: its own SPECLAB_HOME and SQLite MLflow store."""
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.update({
        "SPECLAB_HOME": str(tmp_path / "home"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "PYTHONUNBUFFERED": "1",
        # as if the venv were activated: `python` in job entrypoints is the venv's
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
    })
    return env


def run_cmd(args: list[str], env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``args`` to completion in its own process group (like ``subprocess.run``); on a
    timeout or an interrupt, stop everything it started, not only the direct child."""
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    tree = _Tree(proc)
    watcher = threading.Thread(target=tree.watch, daemon=True)
    watcher.start()  # learns Ray's workers while their parents live (they leave the group)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        tree.stop_watching(watcher)
        stop_process_tree(proc, grace=10, tree=tree)
        raise
    tree.stop_watching(watcher)
    stop_process_tree(proc, grace=10, tree=tree)  # a no-op unless something outlived it
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def refused_before_work(job: str, config: str, overrides: list[str], message: str, env: dict,
                        storage: Path) -> subprocess.CompletedProcess:
    """``python -m jobs.<job> --config <config> <overrides>`` must exit 2 with ``message``
    on stderr before Ray starts (no "running on" line); returns the finished run.

    Run in this process (``speclab.jobs.<job>.main``, what ``jobs/<job>.py`` calls), with
    ``env``'s SPECLAB_HOME, the checkout as working folder and ``ray.init`` replaced by a
    failure, so "before Ray" is checked, not assumed; tracking is off (an MLflow store
    opened here would stay this process's default). A job's start-up costs ~10 s of
    imports in a subprocess, and bad input is refused while parsing and preparing."""
    import contextlib
    import io

    import ray

    from speclab.jobs import job_main

    def no_ray(*args, **kwargs):
        raise AssertionError(f"{job}: Ray started, the input was not refused before work")

    out, err = io.StringIO(), io.StringIO()
    saved = {k: os.environ.get(k) for k in ("SPECLAB_HOME", "MLFLOW_TRACKING_URI")}
    init, cwd = ray.init, os.getcwd()
    from speclab.config import JOB_CONFIGS

    own = ([f"output.storage_path={storage}"] if "output" in JOB_CONFIGS[job].model_fields
           else [])
    argv = ["--config", config, *overrides, *own, "tracking.enabled=false"]
    try:
        os.environ.update({k: env[k] for k in saved})
        os.chdir(ROOT)
        ray.init = no_ray
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = job_main(job)(argv)
            except SystemExit as exc:
                rc = exc.code
    finally:
        ray.init = init
        os.chdir(cwd)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    res = subprocess.CompletedProcess(argv, rc, out.getvalue(), err.getvalue())
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert message in res.stderr, res.stderr[-2000:]
    assert "running on" not in res.stdout
    return res


def python() -> str:
    return sys.executable


def find_run(tracking_uri: str, experiment: str):
    """The single top-level run of ``experiment`` in the store (its child runs aside),
    via the MLflow client."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"experiment {experiment!r} not found"
    runs = [r for r in client.search_runs([exp.experiment_id])
            if "mlflow.parentRunId" not in r.data.tags]
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return client, runs[0]


def method_children(client, run) -> dict:
    """``{method label: child run}`` of the per-method child runs under ``run``; checks
    that they all carry the same metric keys and a ``method.name`` param."""
    runs = client.search_runs([run.info.experiment_id],
                              f"tags.mlflow.parentRunId = '{run.info.run_id}' "
                              "and tags.kind = 'method'", max_results=1000)
    children = {r.data.tags["method"]: r for r in runs}
    assert len(children) == len(runs), "two children with one label"
    keys = {tuple(sorted(r.data.metrics)) for r in runs}
    assert len(keys) <= 1, [sorted(set(k) ^ set(next(iter(keys)))) for k in keys]
    assert all(r.data.params.get("method.name") for r in runs)
    assert all(r.info.status == "FINISHED" for r in runs)
    return children

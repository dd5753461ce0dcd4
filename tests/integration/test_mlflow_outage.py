"""The MLflow tracking server goes away during a job (a real ``mlflow server``, stopped by
its process group and restarted on the same port and store):

* it comes back: the training keeps going, buffered per-step metrics reach the run,
  every step exactly once, and the run ends FINISHED;
* it never comes back within the flush budget: the job exits non-zero naming the server
  and the undelivered points, the run is not FINISHED, the checkpoints are complete and
  a ``train.resume=true`` rerun delivers the spooled points and finishes;
* the driver's tracker retries a call until the server answers, or gives up clearly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from tests.integration.conftest import (
    ROOT,
    _Tree,
    free_port,
    python,
    run_cmd,
    stop_process_tree,
)

pytestmark = pytest.mark.integration
SMOKE = "experiments/smoke/train_target.yaml"
MLFLOW = str(Path(sys.executable).parent / "mlflow")
REPORT_EVERY = 10


class MlflowServer:
    """``mlflow server`` on 127.0.0.1:``port`` over a SQLite store in ``root`` (light mode:
    one worker, no job runner), in its own process group; restartable on the same port."""

    def __init__(self, root: Path, port: int) -> None:
        self.root, self.port = root, port
        self.uri = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, timeout: float = 120) -> float:
        """Start the server; returns the seconds it took to answer."""
        self.root.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
        self.starts += 1
        log = open(self.root / f"server{self.starts}.log", "w")  # noqa: SIM115
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [MLFLOW, "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers",
             "1", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
             "--artifacts-destination", str(self.root / "artifacts")],
            cwd=self.root, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
        log.close()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                pytest.fail("mlflow server exited: " + self.log_tail())
            try:
                if requests.post(f"{self.uri}/api/2.0/mlflow/experiments/search",
                                 json={"max_results": 1}, timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except requests.RequestException:
                pass
            time.sleep(0.3)
        pytest.fail(f"mlflow server on port {self.port} not ready in {timeout} s: "
                    + self.log_tail())

    def stop(self) -> None:
        if self.proc is not None:
            stop_process_tree(self.proc, grace=15)
            self.proc = None

    def log_tail(self) -> str:
        return (self.root / f"server{self.starts}.log").read_text()[-2000:]


class Job:
    """A job subprocess in its own session, its output collected line by line (with the
    time each line arrived) and its process tree watched so it can be stopped whole."""

    def __init__(self, args: list[str], env: dict) -> None:
        self.proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self.tree = _Tree(self.proc)
        self._watch = threading.Thread(target=self.tree.watch, daemon=True)
        self._watch.start()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def steps_logged(self, since: float = 0.0) -> list[str]:
        """The ``[train] step`` lines printed after monotonic time ``since``."""
        return [line for t, line in list(self.lines) if t >= since and "[train] step" in line]

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"job still running after {timeout} s:\n{self.output()[-4000:]}")

    def output(self) -> str:
        self._reader.join(timeout=5)
        return "\n".join(line for _, line in list(self.lines))

    def stop(self) -> None:
        self.tree.stop_watching(self._watch)
        stop_process_tree(self.proc, grace=30, tree=self.tree)


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri)


def _wait_for_first_metrics(job: Job, uri: str, experiment: str, timeout: float = 240):
    """Poll the server until the job's run has a ``loss`` point; returns the run id."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if job.proc.poll() is not None:
            pytest.fail("job ended before its first metrics:\n" + job.output()[-4000:])
        try:
            client = _client(uri)
            exp = client.get_experiment_by_name(experiment)
            runs = client.search_runs([exp.experiment_id]) if exp else []
            if runs and client.get_metric_history(runs[0].info.run_id, "loss"):
                return runs[0].info.run_id
        except Exception:  # the server is busy with the job's own calls: poll again
            pass
        time.sleep(0.5)
    pytest.fail("no step metrics reached the server:\n" + job.output()[-4000:])


def _train_args(storage: Path, uri: str, experiment: str, steps: int, run_name: str,
                *extra: str) -> list[str]:
    return [python(), "-m", "jobs.train_target", "--config", SMOKE, f"train.steps={steps}",
            f"train.report_every={REPORT_EVERY}", f"tracking.uri={uri}",
            f"tracking.experiment={experiment}", f"output.storage_path={storage}",
            f"output.run_name={run_name}", "output.register_as=null", *extra]


def _assert_each_step_once(client, run_id: str, steps: int) -> None:
    want = list(range(REPORT_EVERY, steps + 1, REPORT_EVERY))
    for key in ("loss", "val_loss", "tokens_per_s_per_worker"):
        got = sorted(m.step for m in client.get_metric_history(run_id, key))
        assert got == want, (key, got)


def _report(**figures) -> None:
    print("[outage-figures] " + " ".join(f"{k}={v}" for k, v in figures.items()), flush=True)


def test_training_survives_an_outage_and_delivers_every_step(job_env, tmp_path):
    steps = 400
    server = MlflowServer(tmp_path / "mlflow", free_port())
    job = None
    t_start = time.monotonic()
    try:
        server.start()
        env = dict(job_env, MLFLOW_TRACKING_URI=server.uri)
        job = Job(_train_args(tmp_path / "runs", server.uri, "outage", steps, "out"), env)
        run_id = _wait_for_first_metrics(job, server.uri, "outage")
        t_down = time.monotonic()
        server.stop()
        time.sleep(15)  # the server stays away; the job must keep training meanwhile
        during = sorted(set(job.steps_logged(since=t_down)))  # Ray may echo a line twice
        assert during, "no training progress while the server was down:\n" + job.output()[-3000:]
        assert job.proc.poll() in (None, 0), job.output()[-4000:]
        restart_s = server.start()
        down_s = time.monotonic() - t_down
        rc = job.wait(timeout=300)
        out = job.output()
        assert rc == 0, out[-5000:]
        assert f"[tracking] MLflow server {server.uri} unreachable" in out, out[-4000:]
        client = _client(server.uri)
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED"
        _assert_each_step_once(client, run_id, steps)
        assert run.data.metrics["final_step"] == steps
        assert not (tmp_path / "runs" / "out" / "tracking_spool.json").exists()
        buffered = sorted({line.split("[tracking] ")[-1] for line in out.splitlines()
                           if "buffered metric points" in line})
        _report(down_s=round(down_s, 1), restart_s=round(restart_s, 1),
                steps_during_outage=len(during), delivered=buffered,
                test_s=round(time.monotonic() - t_start, 1))
    finally:
        if job is not None:
            job.stop()
        server.stop()


def test_server_never_back_fails_clearly_and_resume_finishes(job_env, tmp_path):
    steps = 120
    storage = tmp_path / "runs"
    run_dir = storage / "gone"
    server = MlflowServer(tmp_path / "mlflow", free_port())
    job = None
    t_start = time.monotonic()
    try:
        server.start()
        env = dict(job_env, MLFLOW_TRACKING_URI=server.uri,
                   SPECLAB_TRACKING_FLUSH_TIMEOUT_S="5")
        job = Job(_train_args(storage, server.uri, "gone", steps, "gone"), env)
        run_id = _wait_for_first_metrics(job, server.uri, "gone")
        server.stop()  # for good
        t_down = time.monotonic()
        rc = job.wait(timeout=300)
        fail_s = time.monotonic() - t_down
        out = job.output()
    finally:
        if job is not None:
            job.stop()
        server.stop()
    assert rc != 0, out[-4000:]
    assert "TrackingUnavailable" in out, out[-4000:]
    assert f"did not reach MLflow server {server.uri}" in out, out[-4000:]
    assert "train.resume=true output.run_name=gone" in out, out[-4000:]
    spool = json.loads((run_dir / "tracking_spool.json").read_text())
    undelivered = len(spool["points"])
    assert undelivered > 0 and f"{undelivered} metric points" in out, out[-4000:]
    assert {p[0] for p in spool["points"]} == {run_id}
    # the checkpoints are complete: the last one holds the last step
    snap = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
    last = snap["checkpoint_results"][-1]
    assert last["metrics"]["step"] == steps
    assert (run_dir / last["checkpoint_dir_name"] / "state.pt").exists()
    assert not (run_dir / "model").exists()  # the job stopped before its final save

    try:
        server.start()
        client = _client(server.uri)
        assert client.get_run(run_id).info.status != "FINISHED"
        logged = {m.step for m in client.get_metric_history(run_id, "loss")}
        assert max(logged) < steps  # the points logged after the outage are not there yet
        t_resume = time.monotonic()
        res = run_cmd(_train_args(storage, server.uri, "gone", steps, "gone",
                                  "train.resume=true"),
                      dict(job_env, MLFLOW_TRACKING_URI=server.uri), timeout=300)
        resume_s = time.monotonic() - t_resume
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        # the spooled points reached the old run: every step exactly once
        _assert_each_step_once(client, run_id, steps)
        assert client.get_run(run_id).info.status != "FINISHED"
        assert not (run_dir / "tracking_spool.json").exists()
        exp = client.get_experiment_by_name("gone")
        runs = {r.info.run_id: r for r in client.search_runs([exp.experiment_id])}
        new = [r for rid, r in runs.items() if rid != run_id]
        assert len(new) == 1 and new[0].info.status == "FINISHED"
        assert new[0].data.metrics["final_step"] == steps
        assert (run_dir / "model" / "config.json").exists()
        _report(undelivered_points=undelivered, fail_after_outage_s=round(fail_s, 1),
                resume_s=round(resume_s, 1), test_s=round(time.monotonic() - t_start, 1))
    finally:
        server.stop()


def test_driver_calls_wait_for_the_server_or_fail_clearly(tmp_path, monkeypatch):
    import mlflow

    from speclab.tracking import MlflowTracker, TrackingUnavailable

    for name, value in (("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0"),
                        ("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0"),
                        ("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")):
        monkeypatch.setenv(name, value)  # restored after the test
    server = MlflowServer(tmp_path / "mlflow", free_port())
    try:
        server.start()
        # comes back: the call blocks until the server answers, then the run finishes
        with MlflowTracker(server.uri, "driver", "back", {"a": 1}, retry_s=120) as t:
            server.stop()
            restarter = threading.Thread(target=server.start)
            t0 = time.monotonic()
            restarter.start()
            t.log_metrics({"x": 1.0}, step=1)
            waited = time.monotonic() - t0
            restarter.join()
        client = _client(server.uri)
        assert client.get_run(t.run_id).info.status == "FINISHED"
        assert [(m.step, m.value) for m in client.get_metric_history(t.run_id, "x")] == [
            (1, 1.0)]
        # never back within the budget: a clear error, and the run is not FINISHED
        tracker = MlflowTracker(server.uri, "driver", "gone", {"a": 1}, retry_s=3)
        t0 = time.monotonic()
        with pytest.raises(TrackingUnavailable, match=f"MLflow tracking server {server.uri} "
                                                      "unreachable"):
            with tracker as t:
                server.stop()
                t.log_metrics({"x": 1.0}, step=1)
        gave_up = time.monotonic() - t0
        assert gave_up < 30
        server.start()
        assert _client(server.uri).get_run(tracker.run_id).info.status == "RUNNING"
        assert mlflow.active_run() is None
        _report(driver_waited_s=round(waited, 1), driver_gave_up_s=round(gave_up, 1))
    finally:
        server.stop()
        mlflow.set_tracking_uri(None)


def test_a_run_that_fails_while_opening_is_failed_not_finished(tmp_path, monkeypatch):
    """If logging the config fails inside ``with tracker:`` setup, the run (and a child
    run that fails the same way) ends FAILED at once and leaves MLflow's run stack empty,
    so MLflow's exit hook cannot mark it FINISHED."""
    import mlflow
    from mlflow.tracking import MlflowClient

    from speclab import tracking

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("SPECLAB_HOME", str(tmp_path / "home"))

    def refuse(self, text, name):
        raise ValueError("store refused config.yaml")

    with tracking.MlflowTracker(uri, "opening", "parent", {"a": 1}) as parent:
        with monkeypatch.context() as m:
            m.setattr(tracking.MlflowTracker, "log_text", refuse)
            with pytest.raises(ValueError, match="refused"):
                with parent.child("child", {"b": 2}):
                    pass
        assert mlflow.active_run().info.run_id == parent.run_id  # the child was popped
    monkeypatch.setattr(tracking.MlflowTracker, "log_text", refuse)
    with pytest.raises(ValueError, match="refused"):
        with tracking.MlflowTracker(uri, "opening", "alone", {"a": 1}):
            pass
    assert mlflow.active_run() is None
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("opening")
    status = {r.info.run_name: r.info.status for r in client.search_runs([exp.experiment_id])}
    assert status == {"parent": "FINISHED", "child": "FAILED", "alone": "FAILED"}
    mlflow.set_tracking_uri(None)

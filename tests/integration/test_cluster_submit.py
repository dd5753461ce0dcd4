"""A two-node Ray cluster on 127.0.0.1; jobs.evaluate submitted through the Jobs API
(the `speclab submit` path); the MLflow run found through the MLflow client."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.conftest import ROOT, free_port, python, run_cmd, stop_process_tree
from tests.integration.test_evaluate_job import check_evaluate_run

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def two_node_cluster(job_env, tmp_path):
    """A head and a worker, each ``ray start --block`` in a process group of its own; at
    teardown exactly those two groups (and what they started) are stopped."""
    ray_bin = str(Path(python()).parent / "ray")
    gcs, dash = free_port(), free_port()
    dashboard = f"http://127.0.0.1:{dash}"
    # short paths (Ray's socket paths are length-limited), one per node: nodes on one host
    # that share a session directory re-extract each other's runtime_env packages under
    # running processes (their working directory vanishes)
    temp = Path("/tmp") / f"rt{os.getpid()}"
    temp_worker = Path("/tmp") / f"rw{os.getpid()}"
    # explicit ports where Ray has fixed defaults (client server 10001, agent 52365), so
    # the two nodes, and any other Ray on this machine, never compete for them
    head_args = ["--head", f"--port={gcs}", "--num-cpus=2", "--dashboard-host=127.0.0.1",
                 f"--dashboard-port={dash}", f"--ray-client-server-port={free_port()}",
                 f"--dashboard-agent-listen-port={free_port()}",
                 "--node-ip-address=127.0.0.1", "--object-store-memory=500000000",
                 f"--temp-dir={temp}", "--disable-usage-stats"]
    worker_args = [f"--address=127.0.0.1:{gcs}", "--num-cpus=1",
                   f"--dashboard-agent-listen-port={free_port()}",
                   "--node-ip-address=127.0.0.1", "--object-store-memory=300000000",
                   "--memory=3000000000", f"--temp-dir={temp_worker}"]
    nodes: list[tuple[subprocess.Popen, Path]] = []
    try:
        for name, args in (("head", head_args), ("worker", worker_args)):
            log = tmp_path / f"ray-{name}.log"
            with open(log, "w") as out:
                nodes.append((subprocess.Popen([ray_bin, "start", *args, "--block"], cwd=ROOT,
                                               env=job_env, stdout=out,
                                               stderr=subprocess.STDOUT,
                                               start_new_session=True), log))
            _wait_for_alive_nodes(dashboard, len(nodes), nodes)
        yield dashboard
    finally:
        for proc, _ in reversed(nodes):  # the worker first, then the head
            stop_process_tree(proc, grace=30, leader_grace=60)
        shutil.rmtree(temp, ignore_errors=True)
        shutil.rmtree(temp_worker, ignore_errors=True)


def _wait_for_alive_nodes(dashboard: str, want: int, nodes, timeout: float = 180) -> None:
    """Until the cluster reports ``want`` alive nodes (state API through the dashboard)."""
    from ray.util.state import list_nodes

    deadline = time.time() + timeout
    alive = 0
    while time.time() < deadline:
        for proc, log in nodes:
            if proc.poll() is not None:
                pytest.fail(f"ray start exited ({proc.returncode}): {log.read_text()[-3000:]}")
        try:
            alive = len(list_nodes(address=dashboard, filters=[("state", "=", "ALIVE")],
                                   timeout=10, raise_on_missing_output=False))
        except Exception:  # dashboard not up yet
            alive = 0
        if alive >= want:
            return
        time.sleep(1)
    pytest.fail(f"{alive} of {want} Ray nodes alive after {timeout}s: "
                + " | ".join(log.read_text()[-1500:] for _, log in nodes))


PROBE = ("import ray, platform; ray.init(); "
         "print('NODES', sum(n['Alive'] for n in ray.nodes())); "
         "print('SYSTEM', ray.get(ray.remote(lambda: platform.system()).remote()))")


def test_submit_evaluate_to_two_node_cluster(two_node_cluster, job_env):
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(two_node_cluster)
    # both nodes joined, and `import platform` works inside Ray workers
    probe = client.submit_job(entrypoint=f'python -c "{PROBE}"',
                              runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled"}})
    assert _wait(client, probe) == "SUCCEEDED", client.get_job_logs(probe)
    logs = client.get_job_logs(probe)
    assert "NODES 2" in logs and "SYSTEM Linux" in logs, logs

    out = run_cmd([python(), "-m", "speclab.cli", "submit", "evaluate", "--config",
                   "experiments/smoke/evaluate.yaml", "--address", two_node_cluster], job_env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "submitted job" in out.stdout and "SUCCEEDED" in out.stdout
    assert "cluster at" in out.stdout  # the job joined the cluster, no embedded Ray
    job_id = re.search(r"submitted job (\S+)", out.stdout).group(1)
    check_evaluate_run(job_env["MLFLOW_TRACKING_URI"], ray_job=job_id.strip("'\",:"))

    # plain Ray works too: the working_dir honours .gitignore (no .venv upload)
    plain = run_cmd(["ray", "job", "submit", "--address", two_node_cluster, "--working-dir",
                     ".", "--", "python", "-m", "jobs.evaluate", "--config",
                     "experiments/smoke/evaluate.yaml", "tracking.experiment=plain-submit"],
                    job_env)
    assert plain.returncode == 0, plain.stdout[-3000:] + plain.stderr[-3000:]
    check_evaluate_run(job_env["MLFLOW_TRACKING_URI"], "plain-submit")


def _wait(client, job_id, timeout=300) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        status = str(client.get_job_status(job_id))
        if status in ("SUCCEEDED", "FAILED", "STOPPED"):
            return status
        time.sleep(1)
    return "TIMEOUT"

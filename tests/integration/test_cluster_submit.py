"""A two-node Ray cluster on 127.0.0.1; jobs.evaluate submitted through the Jobs API
(the `speclab submit` path); the MLflow run found through the MLflow client."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from tests.integration.conftest import free_port, python, run_cmd
from tests.integration.test_evaluate_job import check_evaluate_run

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def two_node_cluster(job_env, tmp_path):
    ray_bin = str(Path(python()).parent / "ray")
    gcs, dash = free_port(), free_port()
    # short paths (Ray's socket paths are length-limited), one per node: nodes on one host
    # that share a session directory re-extract each other's runtime_env packages under
    # running processes (their working directory vanishes)
    temp = Path("/tmp") / f"rt{os.getpid()}"
    temp_worker = Path("/tmp") / f"rw{os.getpid()}"
    head = run_cmd([ray_bin, "start", "--head", f"--port={gcs}", "--num-cpus=2",
                    "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
                    "--node-ip-address=127.0.0.1", "--object-store-memory=500000000",
                    f"--temp-dir={temp}", "--disable-usage-stats"], job_env, timeout=180)
    try:
        assert head.returncode == 0, head.stderr[-2000:]
        worker = run_cmd([ray_bin, "start", f"--address=127.0.0.1:{gcs}", "--num-cpus=1",
                          "--node-ip-address=127.0.0.1", "--object-store-memory=300000000",
                          "--memory=3000000000", f"--temp-dir={temp_worker}"], job_env,
                         timeout=180)
        assert worker.returncode == 0, worker.stderr[-2000:]
        yield f"http://127.0.0.1:{dash}"
    finally:
        run_cmd([ray_bin, "stop", "--force"], job_env, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)
        shutil.rmtree(temp_worker, ignore_errors=True)


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
    check_evaluate_run(job_env["MLFLOW_TRACKING_URI"])

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

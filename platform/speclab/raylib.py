"""Ray glue: start or join Ray, and the runtime_env that ships the project to a cluster.

Only jobs, serve apps and this module import ``ray``.
"""

from __future__ import annotations

import os
from pathlib import Path

from speclab.paths import repo_root
from speclab.tracking import git_commit

# never uploaded with the working_dir (the virtualenv alone is ~2 GB)
EXCLUDES = [".venv", ".git", "**/__pycache__", ".speclab", "mlruns", "mlartifacts",
            "bench_out", ".pytest_cache", ".ruff_cache", "*.egg-info"]
# SPECLAB_PLUGINS: plugin modules (losses, data kinds) every worker imports (speclab.plugins)
FORWARDED_ENV = ("SPECLAB_HOME", "MLFLOW_TRACKING_URI", "HF_HOME", "HF_HUB_OFFLINE",
                 "SPECLAB_PLUGINS")


def quiet_ray_env() -> None:
    """Local development defaults (see ENVIRONMENT.md: auth token, usage stats)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def init_ray(address: str | None = None, num_cpus: int | None = None) -> str:
    """Join ``address`` (or ``$RAY_ADDRESS``), else start an embedded local Ray.

    The embedded Ray is always a fresh instance owned by this process (``address="local"``):
    a bare ``ray.init()`` would join whatever cluster ``ray start --head`` last recorded
    in /tmp/ray/ray_current_cluster. It stops when this process exits. Its ports (GCS,
    raylet, workers, the metrics exporter) are Ray's own choice and listen on every
    interface (the README's list). Returns a short description of where the job runs.
    """
    quiet_ray_env()
    import ray

    if ray.is_initialized():
        return "already initialised"
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return f"cluster at {address}"
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
             log_to_driver=True)
    return "embedded local Ray"


def project_runtime_env(extra_env: dict[str, str] | None = None) -> dict:
    """The runtime_env that ships this checkout: working_dir + the speclab package."""
    root = repo_root()
    env = {k: os.environ[k] for k in FORWARDED_ENV if os.environ.get(k)}

    env["SPECLAB_GIT_COMMIT"] = git_commit()
    env.update({"RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")})
    env.update(extra_env or {})
    return {
        "working_dir": str(root),
        "py_modules": [str(Path(root) / "platform" / "speclab")],
        "excludes": EXCLUDES,
        "env_vars": env,
    }

"""Argument parsing, config loading and tracker opening shared by every job.

Every job starts the same way: parse ``--config PATH [--address ADDR] [key=value ...]``,
validate the config, open the MLflow run and check the job's inputs, all before Ray
starts, so a bad field fails in a second with exit status 2 and a message naming it.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from speclab.config import JOB_CONFIGS, ConfigError, ExperimentConfig
from speclab.paths import speclab_home
from speclab.tracking import TrackingUnavailable, open_tracker

T = TypeVar("T")


def parse_job_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    """``--config PATH [--address ADDR] [key=value ...]``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--config", required=True, help="experiments/<x>.yaml")
    p.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS or embedded)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. method.gamma=3")
    return p.parse_args(argv)


def load_or_exit(schema: type[ExperimentConfig], path: str, overrides: list[str]):
    """Validate the config as ``schema`` (a job's config model) or print the bad fields
    and exit with status 2 (before any work)."""
    try:
        return schema.from_yaml(path, overrides)
    except ConfigError as exc:
        print(f"config error in {path}:\n{exc}", file=sys.stderr)
        sys.exit(2)


@dataclass
class JobStart(Generic[T]):
    """What :func:`start_job` hands a job: its arguments, config, tracker and inputs."""

    args: argparse.Namespace
    cfg: ExperimentConfig
    tracker: Any  # speclab.tracking.Tracker (opened lazily by ``with``)
    inputs: T

    @property
    def address(self) -> str | None:
        """The Ray address: ``--address``, else ``ray.address`` from the config."""
        return self.args.address or self.cfg.ray.address


def start_job(job: str, description: str | None, argv: list[str] | None,
              prepare: Callable[[Any], T] | None = None) -> JobStart[T]:
    """Parse, validate as ``job``'s config, open the tracker and run ``prepare(cfg)``;
    exit 2 on bad input (a group the job does not use included).

    ``prepare`` checks and loads the job's inputs (corpus, models, interactions) on the
    driver; any ``ValueError``/``OSError`` it raises is printed as ``error: ...``.
    """
    args = parse_job_args(description or f"the {job} job", argv)
    cfg = load_or_exit(JOB_CONFIGS[job], args.config, args.overrides)
    try:  # a remote tracking server is checked before any expensive work
        tracker = open_tracker(cfg.tracking.enabled, cfg.tracking.uri, cfg.tracking.experiment,
                               parent_run_name(cfg), cfg.dump())
        inputs = prepare(cfg) if prepare is not None else None
    except (TrackingUnavailable, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    return JobStart(args, cfg, tracker, inputs)


def parent_run_name(cfg: Any) -> str:
    """The job's MLflow parent run name: ``tracking.run_name``, else the training job's
    ``output.run_name`` (the folder its checkpoints go to, so the run and the folder
    share a name), else the config's ``name``."""
    output = getattr(cfg, "output", None)
    return cfg.tracking.run_name or getattr(output, "run_name", None) or cfg.name


def run_dirs(cfg: Any) -> tuple[Path, str]:
    """(storage folder, run name) from the ``output`` group of a training job's config."""
    storage = Path(cfg.output.storage_path or speclab_home() / "runs").expanduser().resolve()
    return storage, cfg.output.run_name or f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"

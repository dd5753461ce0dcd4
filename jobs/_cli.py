"""Argument parsing and config loading shared by every job (fail fast, name the field)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from speclab.config import ConfigError, ExperimentConfig, StrictModel


def parse_job_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    """``--config PATH [--address ADDR] [key=value ...]``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--config", required=True, help="experiments/<x>.yaml")
    p.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS or embedded)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. method.gamma=3")
    return p.parse_args(argv)


def load_or_exit(schema: type[StrictModel], path: str, overrides: list[str]):
    """Validate the config or print the bad fields and exit with status 2 (before any work)."""
    try:
        return schema.from_yaml(path, overrides)
    except ConfigError as exc:
        print(f"config error in {path}:\n{exc}", file=sys.stderr)
        sys.exit(2)


def run_dirs(cfg: ExperimentConfig) -> tuple[Path, str]:
    """(storage folder, run name) from the ``output`` group."""
    from speclab.paths import speclab_home

    storage = Path(cfg.output.storage_path or speclab_home() / "runs").expanduser().resolve()
    return storage, cfg.output.run_name or f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"

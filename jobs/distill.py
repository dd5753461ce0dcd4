"""Distil a drafter for a target (signals on Ray actors, Ray Train, MLflow, evaluation).

    python -m jobs.distill --config experiments/smoke/distill.yaml [key=value ...]

Runs ``speclab.jobs.distill.main`` (also ``speclab run distill``).
"""

import sys

import jobs  # noqa: F401  (makes speclab importable from a plain checkout)
from speclab.jobs.distill import main

if __name__ == "__main__":
    sys.exit(main())

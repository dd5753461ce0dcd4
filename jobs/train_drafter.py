"""Train any trained drafter family by name (its data on Ray actors, Ray Train, MLflow).

    python -m jobs.train_drafter --config experiments/x.yaml [key=value ...]

Runs ``speclab.jobs.train_drafter.main`` (also ``speclab run train_drafter``).
"""

import sys

import jobs  # noqa: F401  (makes speclab importable from a plain checkout)
from speclab.jobs.train_drafter import main

if __name__ == "__main__":
    sys.exit(main())

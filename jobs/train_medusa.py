"""Train Medusa heads (MEDUSA-1 / MEDUSA-2) for a target on Ray Train, calibrated and served.

    python -m jobs.train_medusa --config experiments/smoke/train_medusa.yaml [key=value ...]

Runs ``speclab.jobs.train_medusa.main`` (also ``speclab run train_medusa``).
"""

import sys

import jobs  # noqa: F401  (makes speclab importable from a plain checkout)
from speclab.jobs.train_medusa import main

if __name__ == "__main__":
    sys.exit(main())

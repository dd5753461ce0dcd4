"""Train a SpecDec++ acceptance-prediction head for a drafter, register it in MLflow.

    python -m jobs.train_head --config experiments/smoke/train_head.yaml [key=value ...]

Runs ``speclab.jobs.train_head.main`` (also ``speclab run train_head``).
"""

import sys

import jobs  # noqa: F401  (makes speclab importable from a plain checkout)
from speclab.jobs.train_head import main

if __name__ == "__main__":
    sys.exit(main())

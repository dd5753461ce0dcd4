"""Train a LLaMA-architecture target on a corpus with Ray Train (DDP), register it in MLflow.

    python -m jobs.train_target --config experiments/smoke/train_target.yaml [key=value ...]

Runs ``speclab.jobs.train_target.main`` (also ``speclab run train_target``).
"""

import sys

import jobs  # noqa: F401  (makes speclab importable from a plain checkout)
from speclab.jobs.train_target import main

if __name__ == "__main__":
    sys.exit(main())

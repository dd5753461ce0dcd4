"""Ray Tune sweep over speculative-decoding hyperparameters, tracked in MLflow.

    python -m jobs.tune --config experiments/smoke/tune.yaml [key=value ...]

Runs ``speclab.jobs.tune.main`` (also ``speclab run tune``).
"""

import sys

import jobs  # noqa: F401  (makes speclab importable from a plain checkout)
from speclab.jobs.tune import main

if __name__ == "__main__":
    sys.exit(main())

"""Train an EAGLE feature drafter (target features on Ray actors, Ray Train, MLflow).

    python -m jobs.distill_eagle --config experiments/smoke/distill_eagle.yaml [key=value ...]

Runs ``speclab.jobs.distill_eagle.main`` (also ``speclab run distill_eagle``).
"""

import sys

import jobs  # noqa: F401  (makes speclab importable from a plain checkout)
from speclab.jobs.distill_eagle import main

if __name__ == "__main__":
    sys.exit(main())

"""Evaluate decoding methods over a prompt set on Ray actors that hold the models.

    python -m jobs.evaluate --config experiments/smoke/evaluate.yaml [key=value ...]

Runs ``speclab.jobs.evaluate.main`` (also ``speclab run evaluate``).
"""

import sys

import jobs  # noqa: F401  (makes speclab importable from a plain checkout)
from speclab.jobs.evaluate import main

if __name__ == "__main__":
    sys.exit(main())

"""Retrieval drafting evaluation: AASD Tables 2, 4 and 5 shapes.

    python -m jobs.retrieval_eval --config experiments/retrieval.yaml [key=value ...]

Runs ``speclab.jobs.retrieval_eval.main`` (also ``speclab run retrieval_eval``).
"""

import sys

import jobs  # noqa: F401  (makes speclab importable from a plain checkout)
from speclab.jobs.retrieval_eval import main

if __name__ == "__main__":
    sys.exit(main())

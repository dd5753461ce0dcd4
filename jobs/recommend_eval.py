"""AtSpeed evaluation: Table 1 shape (verification x method x K), WS/AS vs N.

    python -m jobs.recommend_eval --config experiments/smoke/recommend_eval.yaml [key=value ...]

Runs ``speclab.jobs.recommend_eval.main`` (also ``speclab run recommend_eval``).
"""

import sys

import jobs  # noqa: F401  (makes speclab importable from a plain checkout)
from speclab.jobs.recommend_eval import main

if __name__ == "__main__":
    sys.exit(main())

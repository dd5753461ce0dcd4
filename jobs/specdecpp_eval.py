"""SpecDec++ comparison: fixed draft length vs acceptance heads x thresholds (Figure 4).

    python -m jobs.specdecpp_eval --config experiments/specdecpp.yaml [key=value ...]

Runs ``speclab.jobs.specdecpp_eval.main`` (also ``speclab run specdecpp_eval``).
"""

import sys

import jobs  # noqa: F401  (makes speclab importable from a plain checkout)
from speclab.jobs.specdecpp_eval import main

if __name__ == "__main__":
    sys.exit(main())

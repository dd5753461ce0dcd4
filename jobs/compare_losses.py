"""Compare drafter losses: the TALF paper's Table 2 shape (tree method x loss -> tau, speedup).

    python -m jobs.compare_losses --config experiments/distill_compare.yaml [key=value ...]

Runs ``speclab.jobs.compare_losses.main`` (also ``speclab run compare_losses``).
"""

import sys

import jobs  # noqa: F401  (makes speclab importable from a plain checkout)
from speclab.jobs.compare_losses import main

if __name__ == "__main__":
    sys.exit(main())

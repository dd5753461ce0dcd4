"""Compare EAGLE-family losses (eagle, hass, talf) x tree methods -> tau, speedup,
acceptance per draft position.

    python -m jobs.compare_eagle --config experiments/compare_eagle.yaml [key=value ...]

Runs ``speclab.jobs.compare_eagle.main`` (also ``speclab run compare_eagle``).
"""

import sys

import jobs  # noqa: F401  (makes speclab importable from a plain checkout)
from speclab.jobs.compare_eagle import main

if __name__ == "__main__":
    sys.exit(main())

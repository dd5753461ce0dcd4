"""Have the target answer the user turns of conversations itself (self-distillation data).

    python -m jobs.regenerate --config experiments/smoke/regenerate.yaml [key=value ...]

Runs ``speclab.jobs.regenerate.main`` (also ``speclab run regenerate``).
"""

import sys

import jobs  # noqa: F401  (makes speclab importable from a plain checkout)
from speclab.jobs.regenerate import main

if __name__ == "__main__":
    sys.exit(main())

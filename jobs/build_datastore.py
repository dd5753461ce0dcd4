"""Build a REST retrieval datastore (suffix arrays) from a corpus with Ray tasks.

    python -m jobs.build_datastore --config experiments/smoke/build_datastore.yaml [key=value ...]

Runs ``speclab.jobs.build_datastore.main`` (also ``speclab run build_datastore``).
"""

import sys

import jobs  # noqa: F401  (makes speclab importable from a plain checkout)
from speclab.jobs.build_datastore import main

if __name__ == "__main__":
    sys.exit(main())

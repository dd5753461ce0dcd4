"""Train a LLaMA-architecture generative recommender (AtSpeed target) with Ray Train.

    python -m jobs.train_recommender --config experiments/smoke/train_recommender.yaml

Runs ``speclab.jobs.train_recommender.main`` (also ``speclab run train_recommender``).
"""

import sys

import jobs  # noqa: F401  (makes speclab importable from a plain checkout)
from speclab.jobs.train_recommender import main

if __name__ == "__main__":
    sys.exit(main())

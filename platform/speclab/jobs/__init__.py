"""Job entry points: one module per job, each with ``main(argv)`` (its config, the stages
it runs, its tracking), for every name in :data:`JOBS`.

``speclab.jobs.<job>.main(argv)`` is what runs: the checkout's ``jobs/<job>.py``
(``python -m jobs.<job> --config ...``, the documented command) only calls it, and
``speclab run <job>`` (:func:`job_main`) works from an installed package. A job module
composes reusable stages from :mod:`speclab.pipelines` and never imports another job
module (``tests/unit/test_layout.py`` checks both), so where a module lives says what it
is: a job here, a stage there.

A new job: a module here with ``main(argv)``, its name in :data:`JOBS`, a config model in
:mod:`speclab.config.jobs` and a ``jobs/<job>.py`` shim. Importing this package imports
no job module (and no Ray): the CLI reads :data:`JOBS` for its choices.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

JOBS: tuple[str, ...] = ("evaluate", "train_target", "distill", "compare_losses", "distill_eagle",
                         "compare_eagle", "train_medusa", "train_drafter", "train_recommender",
                         "recommend_eval",
                         "train_head", "specdecpp_eval", "build_datastore", "retrieval_eval",
                         "regenerate", "tune")


def job_main(job: str) -> Callable[[list[str] | None], int]:
    """The ``main(argv)`` of ``job`` (``speclab.jobs.<job>``)."""
    if job not in JOBS:
        raise ValueError(f"job: unknown job {job!r}; known: {', '.join(JOBS)}")
    return importlib.import_module(f"speclab.jobs.{job}").main

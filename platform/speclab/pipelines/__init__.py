"""Reusable stages the jobs compose, and every job's entry point (``main(argv)``).

Stages (one module each): :mod:`.cli` (arguments, config, tracker: how every job
starts), :mod:`.actor_eval` (methods vs AR over Ray actors), :mod:`.fit` (Ray Train
fitting of a typed task config), :mod:`.signals` (the target's distillation signals on
Ray actors), :mod:`.drafter` (train, register and evaluate a drafter),
:mod:`.recommender` (AtSpeed data + recommender training), :mod:`.alignment`
(AtSpeed alignment data and drafters), :mod:`.head` (SpecDec++ acceptance heads),
:mod:`.tune_trials` (Ray Tune trainables that train), :mod:`.comparison` (the loss x
method table of loss comparisons), :mod:`.eagle` (EAGLE feature drafters: train, register,
evaluate), :mod:`.medusa` (Medusa heads: train, calibrate, register, evaluate).

Jobs: ``speclab.pipelines.<job>.main(argv)`` for every name in :data:`JOBS`; the
checkout's ``jobs/<job>.py`` (``python -m jobs.<job>``) only calls it, and ``speclab run
<job>`` works from an installed package. A job module imports stages, never another
job module. A new job: a module here with ``main(argv)``, its name in :data:`JOBS`, a
config model in :mod:`speclab.config.jobs` and a ``jobs/<job>.py`` shim.
Only this package (with ``tracking.py``, ``tracking_buffer.py`` and the Ray glue) imports
``ray``/``mlflow``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

JOBS: tuple[str, ...] = ("evaluate", "train_target", "distill", "compare_losses", "distill_eagle",
                         "compare_eagle", "train_medusa", "train_recommender", "recommend_eval",
                         "train_head", "specdecpp_eval", "build_datastore", "retrieval_eval",
                         "tune")


def job_main(job: str) -> Callable[[list[str] | None], int]:
    """The ``main(argv)`` of ``job`` (``speclab.pipelines.<job>``)."""
    if job not in JOBS:
        raise ValueError(f"job: unknown job {job!r}; known: {', '.join(JOBS)}")
    return importlib.import_module(f"speclab.pipelines.{job}").main

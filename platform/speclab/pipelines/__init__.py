"""Reusable stages the jobs compose (the jobs themselves live in :mod:`speclab.jobs`).

One module per stage: :mod:`.cli` (arguments, config, tracker: how every job starts),
:mod:`.actor_eval` (methods vs AR over Ray actors), :mod:`.method_runs` (a child run per
evaluated method), :mod:`.eval_plots` (evaluation plots), :mod:`.fit` (Ray Train fitting
of a typed task config), :mod:`.signals` (the target's distillation signals on Ray
actors), :mod:`.drafter` (train, register and evaluate a drafter), :mod:`.recommender`
(AtSpeed data + recommender training), :mod:`.alignment` (AtSpeed alignment data and
drafters), :mod:`.head` (SpecDec++ acceptance heads), :mod:`.tune_trials` (Ray Tune
trainables that train), :mod:`.comparison` (the loss x method table of loss
comparisons), :mod:`.eagle` (EAGLE feature drafters: train, register, evaluate),
:mod:`.medusa` (Medusa heads: train, calibrate, register, evaluate).

A stage has no ``main`` and imports no job module (:mod:`speclab.jobs`); only this
package and :mod:`speclab.jobs` (with ``tracking.py``, ``tracking_buffer.py`` and the Ray
glue) import ``ray``/``mlflow``.
"""

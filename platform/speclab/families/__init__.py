"""Trained drafter families: one folder per family, one declaration per folder.

A family (:class:`~speclab.families.spec.TrainedFamily`) declares what training it
needs and what it offers: its Ray Train task and task config, its training group, its
objectives (:mod:`speclab.families.objectives`), the data kinds it consumes, the
decoding method and field a trained artifact fills, how an artifact is checked against
a target, its formats and its Tune trial kind. The catalogue
(:mod:`speclab.families.registry`) holds the built-ins (``eagle``, ``medusa``,
``specdecpp``, ``atspeed``) and families from plugins (``$SPECLAB_PLUGINS``); the
generic layers look a family up by name and never name one.
"""

"""The objective registry: every training objective of a drafter family, typed.

An objective (EAGLE's, HASS's, TALF's, EAGLE-3's, MEDUSA-1's, MEDUSA-2's, AtSpeed's, the
KD losses a recommendation drafter trains with) is ONE :class:`Objective` entry: its
family, its knobs class (a :class:`~speclab.config.base.StrictModel` holding only its own
knobs, read from the family's training group by field name: :meth:`Objective.knobs_of`),
the data kind it trains on and its loss (``"module:function"``, imported when first
used). Consumers (config validation of the family's objective field, data generation,
the family's task) look the entry up by name and never compare names: a new objective
is one entry in its family's ``OBJECTIVES`` (the declaration, ``__init__.py``) with its
knobs and loss in the family's ``objectives.py`` (or a plugin module named in
``$SPECLAB_PLUGINS`` calling :func:`register_objective`).

The plain distillation losses of the ``distill`` job (``word_kd``, ``tvd_kd``, ...) keep
their own registry in :mod:`speclab.losses` (entries that know their batches); this one
covers the objectives of trained families, whose batches their tasks build.

Decision: the families' YAML groups stay flat (``eagle.loss: hass``, ``eagle.hass_k``);
each objective's class names the group fields it reads (``fields``: knob -> group
field), so every existing config and sweep path keeps working, while the loss code
receives only its objective's typed knobs.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from speclab.families.spec import load
from speclab.plugins import load_plugins

#: the built-in family packages whose declarations list their objectives (``OBJECTIVES``:
#: pure data, so reading them imports no config, no torch model and no loss)
BUILTIN_PACKAGES: tuple[str, ...] = (
    "speclab.families.eagle",
    "speclab.families.medusa",
    "speclab.families.atspeed",
)


@dataclass(frozen=True)
class Objective:
    """One training objective of a family.

    * ``name`` / ``family``: the objective and the family that trains with it;
    * ``knobs``: ``"module:Class"`` of its typed knobs; ``fields``: knob -> the field of
      the family's training group it is read from (a knob absent here has the same name
      there);
    * ``loss``: ``"module:function"``, ``(model, batch, knobs) -> scalar``;
    * ``data_kind``: the generated data kind it trains on, or ``"module:function"``
      ``(group) -> kind`` when it depends on the group (EAGLE-3's fused features);
    * ``check``: ``"module:function"`` ``(group, name) -> None``: what the training
      group must hold for this objective (a ValueError naming the field: e.g. HASS needs
      an EAGLE-1/2 drafter, ``version: 1``), checked when the group is validated;
    * ``validate``: ``"module:function"`` ``(group, job_cfg) -> None``: checks that need
      the job's other groups (HASS's K against the stored top-k);
    * ``extras``: ``"module:function"`` ``(group, batch, generator) -> dict``: tensors
      added to a training batch (EAGLE's feature noise);
    * ``doc``: one line for tables and errors.
    """

    name: str
    family: str
    loss: str
    data_kind: str
    knobs: str | None = None
    fields: dict[str, str] = field(default_factory=dict)
    check: str | None = None
    validate: str | None = None
    extras: str | None = None
    doc: str = ""

    def knobs_of(self, group: Any) -> Any:
        """The objective's typed knobs read from the family's training ``group``."""
        if self.knobs is None:
            return None
        cls = load(self.knobs)
        return cls.model_validate({k: getattr(group, self.fields.get(k, k))
                                   for k in cls.model_fields})

    def kind_for(self, group: Any) -> str:
        """The data kind this objective trains on with the training ``group``."""
        return load(self.data_kind)(group) if ":" in self.data_kind else self.data_kind

    def fits(self, group: Any) -> bool:
        """Whether the training ``group`` can train this objective (its ``check``)."""
        try:
            self.check_group(group)
        except ValueError:
            return False
        return True

    def check_group(self, group: Any) -> None:
        """ValueError naming the field when ``group`` cannot train this objective."""
        if self.check:
            load(self.check)(group, self.name)

    def check_job(self, group: Any, job: Any) -> None:
        """ValueError naming the fields when ``job``'s other groups do not fit."""
        if self.validate:
            load(self.validate)(group, job)

    def compute(self, model: Any, batch: dict, group: Any) -> Any:
        """The loss on ``batch`` with the knobs read from ``group``."""
        return load(self.loss)(model, batch, self.knobs_of(group))


_OBJECTIVES: dict[str, Objective] = {}
_BUILTIN_LOADED = False


def register_objective(obj: Objective) -> Objective:
    """Add ``obj`` (a name may be registered once; the same entry again is a no-op)."""
    old = _OBJECTIVES.get(obj.name)
    if old is not None and old != obj:
        raise ValueError(f"objective: an objective named {obj.name!r} is already registered")
    _OBJECTIVES[obj.name] = obj
    return obj


def _ensure_builtin() -> None:
    global _BUILTIN_LOADED
    if not _BUILTIN_LOADED:
        for package in BUILTIN_PACKAGES:
            for obj in importlib.import_module(package).OBJECTIVES:
                register_objective(obj)
        _BUILTIN_LOADED = True


def objectives(family: str | None = None, plugins: bool = True) -> dict[str, Objective]:
    """Every registered objective (of ``family`` only, when given): name -> entry;
    ``plugins`` False: the built-ins only (no plugin module imported)."""
    _ensure_builtin()
    if plugins:
        load_plugins()
    return {n: o for n, o in _OBJECTIVES.items() if family is None or o.family == family}


def objective(name: str, family: str, field: str) -> Objective:
    """The objective ``name`` of ``family``; ValueError naming ``field`` and the known
    objectives of the family. Plugin modules are imported only when ``name`` is not a
    built-in (config defaults are validated while ``speclab.config`` is imported, and a
    plugin may itself import the config)."""
    known = objectives(family, plugins=False)
    if name not in known:
        known = objectives(family)
    if not isinstance(name, str) or name not in known:
        raise ValueError(f"{field}: unknown {family} objective {name!r}; known: "
                         f"{', '.join(sorted(known))}")
    return known[name]

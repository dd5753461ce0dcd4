"""The catalogue of trained drafter families: built-ins and plugins, looked up by name.

Built-ins (:data:`BUILTIN`): each family package's ``FAMILY`` declaration
(:class:`~speclab.families.spec.TrainedFamily`), imported on first lookup. A module
named in ``$SPECLAB_PLUGINS`` adds a family with :func:`register_family` when imported
(:mod:`speclab.plugins`), in every process that looks one up (job drivers, Ray Train
workers, Tune trials, Serve replicas).
"""

from __future__ import annotations

from speclab.families.spec import TrainedFamily, load
from speclab.plugins import load_plugins

#: the built-in families' declarations, one per family package
BUILTIN: tuple[str, ...] = (
    "speclab.families.eagle:FAMILY",
    "speclab.families.medusa:FAMILY",
    "speclab.families.specdecpp:FAMILY",
    "speclab.families.atspeed:FAMILY",
)

_FAMILIES: dict[str, TrainedFamily] = {}
_BUILTIN_LOADED = False


def register_family(fam: TrainedFamily) -> TrainedFamily:
    """Add ``fam`` to the catalogue (a name may be registered once; the same declaration
    again, e.g. a module imported twice, is a no-op)."""
    old = _FAMILIES.get(fam.name)
    if old is not None and old != fam:
        raise ValueError(f"family: a family named {fam.name!r} is already registered")
    _FAMILIES[fam.name] = fam
    return fam


def _ensure_builtin() -> None:
    global _BUILTIN_LOADED
    if not _BUILTIN_LOADED:
        for ref in BUILTIN:
            register_family(load(ref))
        _BUILTIN_LOADED = True


def families() -> dict[str, TrainedFamily]:
    """Every registered family: name -> declaration (the plugins' too)."""
    _ensure_builtin()
    load_plugins()
    return dict(_FAMILIES)


def family(name: str, field: str = "family") -> TrainedFamily:
    """The family ``name``; ``ValueError`` naming ``field`` and the known families.
    Plugin modules are imported only when ``name`` is not a built-in, so validating a
    built-in name (config defaults, while ``speclab.config`` is imported) never imports
    a plugin, which may itself import the config."""
    _ensure_builtin()
    known = dict(_FAMILIES) if name in _FAMILIES else families()
    if not isinstance(name, str) or name not in known:
        raise ValueError(f"{field}: unknown drafter family {name!r}; known: "
                         f"{', '.join(sorted(known))}")
    return known[name]


def family_of_method(method: str) -> TrainedFamily | None:
    """The family whose trained artifact feeds decoding method ``method`` (None: none)."""
    return next((f for f in families().values() if f.method == method), None)


def sweep_kinds(kind: str | None = None) -> dict[str, TrainedFamily]:
    """``sweep.kind`` -> the family whose training trials it runs. With ``kind``, the
    plugins are imported only when no built-in family sweeps it."""
    _ensure_builtin()
    found = {f.sweep.kind: f for f in _FAMILIES.values() if f.sweep is not None}
    if kind is not None and kind in found:
        return found
    return {f.sweep.kind: f for f in families().values() if f.sweep is not None}


def artifact_fields() -> dict[str, TrainedFamily]:
    """The method fields trained artifacts fill (``eagle_model``, ...) -> their family."""
    return {f.artifact_field: f for f in families().values() if f.artifact_field}

"""Plugin modules: code outside the package that adds entries to speclab's registries.

``$SPECLAB_PLUGINS`` names modules (comma-separated, importable where the process runs,
e.g. ``mypkg.losses,tests.integration.test_loss_registry``) that register what they add
when imported, e.g. a distillation loss with :func:`speclab.losses.register_loss` or a
kind of target signal with :func:`speclab.train.distill_data.register_data_kind`.

Why an environment variable: a job's work runs in other processes (Ray generation
actors, Ray Train workers) that never execute the driver's imports. Every process
inherits the variable (local Ray starts its workers from the driver's environment, and
:func:`speclab.raylib.project_runtime_env` forwards it to a cluster), and each registry
calls :func:`load_plugins` before its first lookup, so a plugin's entries exist in every
process that looks them up, exactly as in the driver that validated the config.

Decision: one generic variable for every registry that is read by jobs' workers (losses
and data kinds today), rather than one per registry. ``$SPECLAB_METHODS`` predates it
and stays the method registry's own (see :mod:`speclab.config.method`); a module named
in both is imported once, as Python caches modules.
"""

from __future__ import annotations

import importlib
import os

PLUGINS_ENV = "SPECLAB_PLUGINS"
_IMPORTED: set[str] = set()


def plugin_modules() -> list[str]:
    """The module names in ``$SPECLAB_PLUGINS`` (empty entries and spaces ignored)."""
    return [m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",") if m.strip()]


def load_plugins() -> None:
    """Import every module named in ``$SPECLAB_PLUGINS`` not imported yet (cheap to call
    before every lookup: the variable is re-read, so a module named later is picked up).

    A module that fails to import raises ``ImportError`` naming the variable."""
    for name in plugin_modules():
        if name in _IMPORTED:
            continue
        _IMPORTED.add(name)  # first: a plugin that looks a registry up does not recurse
        try:
            importlib.import_module(name)
        except ImportError as err:
            _IMPORTED.discard(name)
            raise ImportError(f"${PLUGINS_ENV}: cannot import plugin module {name!r}: "
                              f"{err}") from err

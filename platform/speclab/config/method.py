"""Method configs: the base every method's typed config derives from, and the registry
that turns ``{name: ..., knobs...}`` into the config model of that method.

Each drafter module (``speclab/drafters/<method>.py``) declares its own config class,
a :class:`MethodSpec` subclass with ``name: Literal["<method>"]``, its knobs (defaults
and bounds, once) and ``build`` (how to make its drafter). ``speclab/drafters/registry.py``
registers the built-in ones; :func:`register` adds more (a test, a plugin module named
in ``$SPECLAB_METHODS``). The CLI flags of ``speclab generate``, ``Decoder.generate``
keywords, YAML ``method:`` groups and the Serve draft deployment all read this registry.

This module imports no drafter (the registry is filled on first use), so config
schemas can use :data:`MethodConfig` as a field type without import cycles.
"""

from __future__ import annotations

import importlib
import os
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field, SerializeAsAny, ValidationError
from pydantic_core import PydanticCustomError

from speclab.config.base import ConfigError, StrictModel, format_validation_error, nested_error
from speclab.plugins import load_plugins

_METHODS: dict[str, type[MethodSpec]] = {}
_LOADED = False


class MethodSpec(StrictModel):
    """Base of a method's config: ``name`` selects the method, ``label`` names it in
    tables; subclasses add their knobs. The method's traits are declared here, on the
    class, so nobody builds a drafter to learn them: ``needs_draft_model`` (it drafts with
    a separate draft LM, ``models.draft`` / ``--draft``), ``drafting`` (False: plain
    decoding), ``needs_features`` (its drafter reads the target's features), and
    :meth:`traits` (override it for knob-dependent traits, as AASD does)."""

    model_config = {"arbitrary_types_allowed": True}

    name: str
    label: str | None = None
    budget: Literal["fixed", "auto"] | None = Field(
        None, description="the draft budget: fixed (the method's own length every round, "
                          "the default) or auto (each round's depth, 0 = plain decoding, "
                          "chosen for committed tokens per second: "
                          "speclab.decoding.budget; outputs unchanged)")
    #: the fields every method has that are not knobs of its drafter
    META: ClassVar[tuple[str, ...]] = ("name", "label", "budget")
    needs_draft_model: ClassVar[bool] = True
    drafting: ClassVar[bool] = True
    needs_features: ClassVar[bool] = False

    def traits(self):
        """What the method's drafts need from a round
        (:class:`speclab.decoding.drafting.DraftTraits`); ``batched`` is True when the
        class overrides :meth:`build_batch`."""
        from speclab.decoding.drafting import DraftTraits

        return DraftTraits(self.drafting, self.needs_features,
                           batched=type(self).build_batch is not MethodSpec.build_batch)

    def draft_length(self) -> int | None:
        """The most draft tokens one round proposes along a path (a chain's length, a
        tree's depth: vLLM's ``num_speculative_tokens``), or None where no knob fixes it
        (the base: a plugin method that does not say)."""
        return None

    def params(self) -> dict:
        """The method's knobs (every field but :attr:`META`), and ``budget`` when one
        is given (``Decoder.generate`` takes it beside the knobs)."""
        out = {k: getattr(self, k) for k in type(self).model_fields if k not in self.META}
        return out if self.budget is None else {**out, "budget": self.budget}

    def build(self, ctx: Any):
        """The drafter for one sequence (``ctx``: :class:`speclab.drafters.registry.BuildContext`);
        ``None`` means plain decoding."""
        raise NotImplementedError(f"method {self.name!r} does not say how to build its drafter")

    def build_batch(self, ctx: Any):
        """A drafter that drafts for MANY rows in batched draft forwards
        (:class:`speclab.decoding.drafting.BatchDrafter`), or None: the batched engine then
        drafts row by row with :meth:`build`'s drafter and still verifies every row in one
        target forward. ``ctx`` as for :meth:`build` (its ``generator`` is unused: each
        row brings its own)."""
        del ctx
        return None


def register(cls: type[MethodSpec]) -> type[MethodSpec]:
    """Register a method config class under its ``name`` literal (usable as a decorator)."""
    name = method_name_of(cls)
    old = _METHODS.get(name)
    if old is not None and old.__qualname__ != cls.__qualname__:
        raise ValueError(f"method: {name!r} is already registered by {old.__module__}")
    _METHODS[name] = cls
    return cls


def method_name_of(cls: type[MethodSpec]) -> str:
    """The single value of a config class's ``name: Literal[...]`` field."""
    ann = cls.model_fields["name"].annotation
    args = getattr(ann, "__args__", ())
    if len(args) != 1 or not isinstance(args[0], str):
        raise TypeError(f"{cls.__name__}: name must be annotated Literal['<method>']")
    return args[0]


def _ensure_loaded() -> None:
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    importlib.import_module("speclab.drafters.registry")  # registers the built-in methods
    for mod in filter(None, os.environ.get("SPECLAB_METHODS", "").split(",")):
        importlib.import_module(mod.strip())


def methods() -> dict[str, type[MethodSpec]]:
    """Every registered method: name -> config class (built-ins first), with those of
    the plugin modules in ``$SPECLAB_PLUGINS`` (a plugin family's method)."""
    _ensure_loaded()
    load_plugins()
    return dict(_METHODS)


def method_class(name: str) -> type[MethodSpec]:
    """The config class of method ``name``; ValueError naming ``method`` if unknown.
    Plugin modules are imported only when ``name`` is not registered yet, so config
    defaults validated while ``speclab.config`` is imported never import a plugin
    (which may itself import the config)."""
    _ensure_loaded()
    known = dict(_METHODS) if name in _METHODS else methods()
    if not isinstance(name, str) or name not in known:
        raise ValueError(f"method: must be one of {list(known)}, got {name!r}")
    return known[name]


def _validate(data: Any) -> MethodSpec:
    if isinstance(data, MethodSpec):
        return data
    if not isinstance(data, dict):
        raise PydanticCustomError("method", "a method must be a mapping with a name, got "
                                            "{got}", {"got": type(data).__name__})
    data = dict(data)
    name = data.setdefault("name", "chain")
    known = methods()
    if not isinstance(name, str) or name not in known:  # a list or mapping is not hashable
        raise PydanticCustomError("nested", "unknown method {got!r}; known: {known}", {
            "got": name, "known": list(known),
            "errors": [(["name"], f"unknown method {name!r}; known: {list(known)}")]})
    try:
        return known[name].model_validate(data)
    except ValidationError as err:
        raise nested_error(err) from None


#: field type of a method config in any schema (``method: MethodConfig``)
MethodConfig = Annotated[SerializeAsAny[MethodSpec], BeforeValidator(_validate)]


def parse_method(data: dict | MethodSpec) -> MethodSpec:
    """A method config from ``{"name": ..., knobs...}``; ConfigError names the field."""
    try:
        return _validate(data)
    except PydanticCustomError as err:
        ctx = err.context or {}
        if "errors" in ctx:
            raise ConfigError("\n".join(f"{'.'.join(map(str, loc))}: {msg}"
                                        for loc, msg in ctx["errors"])) from None
        raise ConfigError(f"method: {err}") from None
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None

"""One strict pydantic base for every config: unknown keys are errors, YAML + overrides.

Errors name the dotted field, e.g. ``method.gamma: Input should be greater than 0``.
Overrides are ``key=value`` strings with dotted paths (list items by index:
``methods.1.gamma=5``); values are parsed as YAML (``3`` -> int, ``[1,2]`` -> list).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic_core import PydanticCustomError

T = TypeVar("T", bound="StrictModel")


class ConfigError(ValueError):
    """Invalid configuration; the message lists every bad field by dotted path."""


def error_lines(err: ValidationError, prefix: tuple = ()) -> list[tuple[tuple, str]]:
    """``(location, message)`` per error of ``err``, with ``prefix`` before each location.

    Errors that carry nested errors of their own (``ctx["errors"]``: a sub-model validated
    inside a validator, e.g. one method's config) are expanded, so their fields keep their
    full dotted path (``method.gamma``). Renamed keys point at the new key.
    """
    out = []
    for e in err.errors():
        loc = prefix + tuple(e["loc"])
        ctx = e.get("ctx") or {}
        if e["type"] == "nested" and "errors" in ctx:
            out += [(loc + tuple(sub), msg) for sub, msg in ctx["errors"]]
        elif e["type"] == "renamed":
            out.append((loc + (ctx["key"],), e["msg"]))
        else:
            msg = e["msg"]
            out.append((loc, msg[len("Value error, "):] if msg.startswith("Value error, ")
                        else msg))
    return out


def format_validation_error(err: ValidationError) -> str:
    """``field.path: message`` lines from a pydantic error."""
    return "\n".join(f"{'.'.join(str(p) for p in loc) or '<root>'}: {msg}"
                     for loc, msg in error_lines(err))


def nested_error(err: ValidationError) -> PydanticCustomError:
    """Re-raise ``err`` (a sub-model validated by hand) so that its field paths survive."""
    lines = error_lines(err)
    detail = "; ".join(f"{'.'.join(map(str, loc))}: {msg}" for loc, msg in lines)
    return PydanticCustomError("nested", "{detail}",
                               {"detail": detail, "errors": [(list(loc), m) for loc, m in lines]})


def apply_override(data: dict, dotted: str, value: Any) -> None:
    """Set ``data[a][b]...`` for ``dotted = "a.b..."`` (integers index lists)."""
    keys = dotted.split(".")
    node: Any = data
    for i, key in enumerate(keys):
        last = i == len(keys) - 1
        if isinstance(node, list):
            if not key.isdigit() or int(key) >= len(node):
                raise ConfigError(f"{'.'.join(keys[: i + 1])}: no such list item")
            key = int(key)
            if last:
                node[key] = value
            else:
                node = node[key]
            continue
        if not isinstance(node, dict):
            raise ConfigError(f"{'.'.join(keys[:i])}: is not a mapping, cannot set {dotted}")
        if last:
            node[key] = value
        else:
            node = node.setdefault(key, {})


def apply_overrides(data: dict, overrides: list[str] | None) -> dict:
    """``data`` with the command line's ``key=value`` ``overrides`` set
    (:func:`apply_override`). A group picked by its ``name`` (a method:
    ``method.name=chain``) that an override switches to another name starts afresh (the
    old method's knobs do not fit the new one); names are set first, so the knobs given
    with the new name land in the new group."""
    pairs = parse_overrides(overrides or [])
    for key, value in sorted(pairs, key=lambda kv: not kv[0].endswith(".name")):
        if key.endswith(".name"):
            group = _node_at(data, key.rsplit(".", 1)[0])
            if isinstance(group, dict) and group.get("name", value) != value:
                group.clear()
        apply_override(data, key, value)
    return data


def _node_at(data: Any, dotted: str) -> Any:
    """``data[a][b]...`` for ``dotted = "a.b..."`` (integers index lists); None if absent."""
    node = data
    for key in dotted.split("."):
        if isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        elif isinstance(node, dict):
            node = node.get(key)
        else:
            return None
    return node


def parse_overrides(pairs: list[str]) -> list[tuple[str, Any]]:
    """``["a.b=3", "c=x"]`` -> ``[("a.b", 3), ("c", "x")]``."""
    out = []
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"override {pair!r}: expected key=value")
        key, raw = pair.split("=", 1)
        if any(not part.strip() for part in key.split(".")):
            raise ConfigError(f"override {pair!r}: the key (before '=') has an empty part")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        out.append((key.strip(), value))
    return out


class StrictModel(BaseModel):
    """Base of all speclab configs: extra keys forbidden, validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    #: old key -> new key: a config that still uses an old key fails naming the new one
    renamed: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _no_renamed_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old, new in cls.renamed.items():
                if old in data:
                    raise PydanticCustomError(
                        "renamed", "renamed: use {new} instead", {"key": old, "new": new})
        return data

    @classmethod
    def from_dict(cls: type[T], data: dict, overrides: list[str] | None = None) -> T:
        """Validate ``data`` after applying ``key=value`` overrides."""
        import copy

        data = apply_overrides(copy.deepcopy(data or {}), overrides)
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            raise ConfigError(format_validation_error(err)) from None

    @classmethod
    def from_yaml(cls: type[T], path: str | Path, overrides: list[str] | None = None) -> T:
        """Load a YAML file (flag > yaml > default)."""
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config: file {str(path)!r} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"config: {path} is not valid YAML: {err}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config: {path} must hold a mapping at the top level")
        return cls.from_dict(data, overrides)

    def to_yaml(self) -> str:
        """The resolved config as YAML."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

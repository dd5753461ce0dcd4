"""One strict pydantic base for every config: unknown keys are errors, YAML + overrides.

Errors name the dotted field, e.g. ``method.gamma: Input should be greater than 0``.
Overrides are ``key=value`` strings with dotted paths (list items by index:
``methods.1.gamma=5``); values are parsed as YAML (``3`` -> int, ``[1,2]`` -> list).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

T = TypeVar("T", bound="StrictModel")


class ConfigError(ValueError):
    """Invalid configuration; the message lists every bad field by dotted path."""


def format_validation_error(err: ValidationError) -> str:
    """``field.path: message`` lines from a pydantic error."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        lines.append(f"{loc}: {e['msg']}")
    return "\n".join(lines)


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


def parse_overrides(pairs: list[str]) -> list[tuple[str, Any]]:
    """``["a.b=3", "c=x"]`` -> ``[("a.b", 3), ("c", "x")]``."""
    out = []
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"override {pair!r}: expected key=value")
        key, raw = pair.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        out.append((key.strip(), value))
    return out


class StrictModel(BaseModel):
    """Base of all speclab configs: extra keys forbidden, validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @classmethod
    def from_dict(cls: type[T], data: dict, overrides: list[str] | None = None) -> T:
        """Validate ``data`` after applying ``key=value`` overrides."""
        import copy

        data = copy.deepcopy(data or {})
        for key, value in parse_overrides(overrides or []):
            apply_override(data, key, value)
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

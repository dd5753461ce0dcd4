"""Typed experiment configs (pydantic, strict) loaded from YAML with key=value overrides."""

from speclab.config.base import ConfigError, StrictModel
from speclab.config.schema import (
    DataConfig,
    DecodingConfig,
    ExperimentConfig,
    MethodConfig,
    ModelsConfig,
    RayConfig,
    ResourcesConfig,
    TrackingConfig,
)

__all__ = [
    "ConfigError",
    "DataConfig",
    "DecodingConfig",
    "ExperimentConfig",
    "MethodConfig",
    "ModelsConfig",
    "RayConfig",
    "ResourcesConfig",
    "StrictModel",
    "TrackingConfig",
]

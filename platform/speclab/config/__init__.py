"""Typed experiment configs (pydantic, strict) loaded from YAML with key=value overrides.

Groups live in :mod:`speclab.config.schema`, one config model per job (made of the
groups that job uses, selected by ``job:``) in :mod:`speclab.config.jobs`.
``load_experiment(path, overrides)`` (= ``ExperimentConfig.from_yaml``) returns the
config of the job the file names.
"""

from speclab.config.base import ConfigError, StrictModel
from speclab.config.jobs import (
    JOB_CONFIGS,
    BuildDatastoreJob,
    CompareEagleJob,
    CompareLossesJob,
    DistillEagleJob,
    DistillJob,
    EvaluateJob,
    ExperimentConfig,
    RecommendEvalJob,
    RegenerateJob,
    RetrievalEvalJob,
    ServeJob,
    SpecdecppEvalJob,
    TrainDrafterJob,
    TrainHeadJob,
    TrainMedusaJob,
    TrainRecommenderJob,
    TrainTargetJob,
    TuneJob,
    load_experiment,
)
from speclab.config.schema import (
    DataConfig,
    DecodingConfig,
    MethodConfig,
    ModelsConfig,
    RayConfig,
    ResourcesConfig,
    TrackingConfig,
)

__all__ = [
    "JOB_CONFIGS",
    "BuildDatastoreJob",
    "CompareEagleJob",
    "CompareLossesJob",
    "ConfigError",
    "DataConfig",
    "DecodingConfig",
    "DistillEagleJob",
    "RegenerateJob",
    "TrainMedusaJob",
    "DistillJob",
    "EvaluateJob",
    "ExperimentConfig",
    "MethodConfig",
    "ModelsConfig",
    "RayConfig",
    "RecommendEvalJob",
    "ResourcesConfig",
    "RetrievalEvalJob",
    "ServeJob",
    "SpecdecppEvalJob",
    "StrictModel",
    "TrackingConfig",
    "TrainDrafterJob",
    "TrainHeadJob",
    "TrainRecommenderJob",
    "TrainTargetJob",
    "TuneJob",
    "load_experiment",
]

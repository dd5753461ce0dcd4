"""ExperimentConfig: the single typed source of truth for a job.

Groups: ``models`` (which target/draft), ``data`` (prompt set), ``decoding`` (sampling
settings shared by all methods), ``method`` (the method and its hyperparameters) or
``methods`` (several to compare), ``resources`` (Ray actors), ``tracking`` (MLflow),
``ray`` (cluster address).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from speclab.config.base import StrictModel

MethodName = Literal["ar", "chain", "tree", "optimal", "salf"]

# hyperparameters each method uses (the rest are ignored for that method)
METHOD_PARAMS: dict[str, tuple[str, ...]] = {
    "ar": (),
    "chain": ("gamma",),
    "tree": ("top_k", "depth", "nodes", "score_temperature"),
    "optimal": ("nodes", "batch", "depth", "score_temperature"),
    "salf": ("nodes", "batch", "threshold", "depth", "score_temperature"),
}


class ModelsConfig(StrictModel):
    """``target``/``draft``: a folder, a hub id, ``reference`` (the trained reference pair,
    built on first use) or ``tiny`` (random tiny models with a real tokenizer, for smoke
    runs). ``draft`` defaults to the partner of a ``reference``/``tiny`` target."""

    target: str = "reference"
    draft: str | None = None
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    device: str = Field("cpu", pattern=r"^(cpu|auto|cuda(:\d+)?)$")


class DataConfig(StrictModel):
    """Prompt set: function headers from the stdlib test split, or a JSONL file."""

    prompts: Literal["stdlib_functions", "jsonl"] = "stdlib_functions"
    path: str | None = None
    num_prompts: int = Field(16, gt=0)
    context_chars: int = Field(300, gt=0)
    seed: int = 0

    @model_validator(mode="after")
    def _path_for_jsonl(self):
        if self.prompts == "jsonl" and not self.path:
            raise ValueError("path is required when prompts is 'jsonl'")
        return self


class DecodingConfig(StrictModel):
    """Sampling settings shared by every method of a run."""

    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k_sampling: int = Field(0, ge=0)
    max_new_tokens: int = Field(64, gt=0)
    seed: int = 0
    verify: Literal["greedy", "sample", "typical"] | None = None


class MethodConfig(StrictModel):
    """A decoding method and its hyperparameters."""

    name: MethodName = "chain"
    gamma: int = Field(4, gt=0, description="chain draft length")
    top_k: int = Field(4, gt=0, description="EAGLE-2 children per node / nodes per level")
    depth: int = Field(5, gt=0, description="maximum draft depth of tree methods")
    nodes: int = Field(16, gt=0, description="draft nodes per tree")
    batch: int = Field(4, gt=0, description="nodes expanded per draft forward (optimal/SALF)")
    threshold: float = Field(0.3, gt=0.0, lt=1.0, description="SALF threshold th")
    score_temperature: float = Field(
        1.0, gt=0.0, description="softmax temperature used to rank tree nodes"
    )
    label: str | None = None

    @model_validator(mode="after")
    def _batch_within_nodes(self):
        if self.name in ("optimal", "salf") and self.batch > self.nodes:
            raise ValueError(f"batch ({self.batch}) must not exceed nodes ({self.nodes})")
        return self

    def params(self) -> dict:
        """Only the hyperparameters this method uses."""
        return {k: getattr(self, k) for k in METHOD_PARAMS[self.name]}


class ResourcesConfig(StrictModel):
    """Ray actors that hold the models (fractional CPUs allowed)."""

    num_actors: int = Field(1, gt=0)
    num_cpus_per_actor: float = Field(1.0, gt=0.0)
    num_gpus_per_actor: float = Field(0.0, ge=0.0)


class TrackingConfig(StrictModel):
    """MLflow: ``uri`` None -> ``$MLFLOW_TRACKING_URI`` or the embedded SQLite store."""

    enabled: bool = True
    uri: str | None = None
    experiment: str = "speclab"
    run_name: str | None = None


class RayConfig(StrictModel):
    """``address`` None -> ``$RAY_ADDRESS`` or an embedded local Ray."""

    address: str | None = None
    num_cpus: int | None = Field(None, gt=0, description="CPUs of an embedded Ray")


class ExperimentConfig(StrictModel):
    """A whole experiment (see ``experiments/*.yaml``)."""

    name: str = "experiment"
    job: Literal["evaluate"] = "evaluate"
    models: ModelsConfig = ModelsConfig()
    data: DataConfig = DataConfig()
    decoding: DecodingConfig = DecodingConfig()
    method: MethodConfig = MethodConfig()
    methods: list[MethodConfig] = Field(default_factory=list)
    resources: ResourcesConfig = ResourcesConfig()
    tracking: TrackingConfig = TrackingConfig()
    ray: RayConfig = RayConfig()

    def method_list(self) -> list[MethodConfig]:
        """``methods`` when given, else the single ``method``."""
        return list(self.methods) or [self.method]

"""One config model per job, made only of the groups that job uses.

The ``job:`` key of an experiment YAML selects the model (``evaluate`` when absent):

==================  ========================================================================
job                 groups (besides ``name``, ``job``, ``tracking``, ``ray``)
==================  ========================================================================
evaluate            models, data, decoding, method, methods, resources
train_target        corpus, tokenizer, arch, train, scaling, output
distill             models, corpus, tokenizer, distill, arch, train, scaling, output,
                    data, decoding, method, methods, resources (the drafter's evaluation)
compare_losses      as distill, plus compare
distill_eagle       models, corpus, tokenizer, distill (generation), eagle, train, scaling,
                    output, data, decoding, method, methods, resources
compare_eagle       as distill_eagle, plus compare (EAGLE-family losses)
train_medusa        models, corpus, tokenizer, distill (generation), medusa, train, scaling,
                    output, data, decoding, method, methods, resources
train_drafter       family, drafter (its training group), models, corpus, tokenizer,
                    distill (generation), train, scaling, output, data, decoding, method,
                    methods, resources
train_recommender   rec, arch, train, scaling, output
recommend_eval      rec, rec_eval, arch, train, scaling, output
train_head          models, corpus, tokenizer, distill (generation), head, train, scaling,
                    output
specdecpp_eval      models, data, decoding, resources, adaptive, and for heads trained on
                    the fly: corpus, tokenizer, distill, head, train, scaling, output
build_datastore     models, corpus, datastore
regenerate          models, corpus (conversations), regenerate
retrieval_eval      models, decoding, method, methods, resources, retrieval
tune                sweep and the groups of its ``sweep.kind`` (:func:`tune_groups`)
serve               models, method, serve
==================  ========================================================================

A group that the job does not use is an error naming it (``head: the evaluate job has
no 'head' group ...``), raised by :meth:`ExperimentConfig.from_dict` before any work.
``ExperimentConfig.from_yaml(path, overrides)`` (or :func:`load_experiment`) returns the
config of the job the file names; ``EvaluateJob.from_yaml(...)`` insists on that job.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import (
    Field,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from speclab.config.base import (
    ConfigError,
    StrictModel,
    apply_overrides,
    error_lines,
    format_validation_error,
)
from speclab.config.method import MethodConfig, MethodSpec, parse_method
from speclab.config.schema import (
    EAGLE_COMPARE_ROWS,
    AdaptiveEvalConfig,
    ArchConfig,
    CompareConfig,
    CorpusConfig,
    DataConfig,
    DatastoreConfig,
    DecodingConfig,
    DistillConfig,
    DraftArchConfig,
    EagleCompareConfig,
    EagleTrainConfig,
    HeadConfig,
    MedusaTrainConfig,
    ModelsConfig,
    OrderingConfig,
    OutputConfig,
    RayConfig,
    RecConfig,
    RecEvalConfig,
    RecTrialConfig,
    RegenerateConfig,
    ResourcesConfig,
    RetrievalEvalConfig,
    ServeConfig,
    SweepConfig,
    TokenizerConfig,
    TrackingConfig,
    TrainConfig,
    TrainScalingConfig,
)
from speclab.families.objectives import objective
from speclab.families.registry import family, sweep_kinds
from speclab.families.spec import TrainedFamily, load

DEFAULT_JOB = "evaluate"


def default_method() -> MethodSpec:
    """The ``method`` of a config that gives none: chain drafting with its defaults."""
    return parse_method({"name": "chain"})


def device_for_gpus(device: str, gpus: float, field: str, holder: str = "the replica") -> str:
    """``models.device`` for a Ray actor that reserves ``gpus`` GPUs (``field``: the setting
    that reserves them, e.g. ``serve.target.num_gpus``): ``auto`` is cuda with GPUs and cpu
    without; an explicit device that contradicts them is refused (ValueError naming both
    fields): GPUs reserved and idle, or a GPU used unreserved by ``holder``."""
    if device == "cpu" and gpus > 0:
        raise ValueError(
            f"models.device: 'cpu' but {field} is {gpus:g}: the GPU would be reserved and "
            "idle; set models.device: auto (or cuda)")
    if device.startswith("cuda") and gpus == 0:
        raise ValueError(
            f"models.device: {device!r} but {field} is 0: {holder} would use a GPU Ray did "
            f"not reserve for it; set {field} (or models.device: auto)")
    if device != "auto":
        return device
    return "cuda" if gpus > 0 else "cpu"


def own_method_knobs(method: dict) -> dict:
    """``method`` without the knobs that its method does not take.

    A sweep over ``method.name`` keeps the knobs of every swept method in one base
    ``method`` (e.g. ``gamma`` for chain and ``salf_threshold`` for salf); each trial,
    and the base itself, keeps only those of its own method.
    """
    try:
        TypeAdapter(MethodConfig).validate_python(method)
        return method
    except ValidationError as err:
        extra = {loc[-1] for loc, msg in error_lines(err)
                 if loc and msg.startswith("Extra inputs are not permitted")}
        return {k: v for k, v in method.items() if k not in extra}


_COMMON = ("name", "job", "tracking", "ray")


class ExperimentConfig(StrictModel):
    """Base of every job's config: ``name``, ``job``, ``tracking``, ``ray``.

    ``ExperimentConfig.from_dict`` / ``from_yaml`` dispatch on ``job`` and return that
    job's config (an :class:`EvaluateJob`, a :class:`DistillJob`, ...); called on a job's
    class they insist on that job.
    """

    name: str = "experiment"
    job: str = DEFAULT_JOB
    tracking: TrackingConfig = TrackingConfig()
    ray: RayConfig = RayConfig()

    @classmethod
    def job_name(cls) -> str | None:
        """The job this class configures (None for the base)."""
        return None if cls is ExperimentConfig else cls.model_fields["job"].default

    @classmethod
    def groups(cls, data: dict | None = None) -> tuple[str, ...]:
        """Top-level keys this job accepts (``data``: the raw config, for tune's kind)."""
        return tuple(cls.model_fields)

    @classmethod
    def precheck(cls, data: dict) -> None:
        """Checks of the raw config that must come before field validation (none here)."""

    @model_validator(mode="after")
    def _batch_sweep_is_evaluates(self):
        """``decoding.batch_sizes`` is the evaluate job's sweep; another job would
        ignore it."""
        decoding = getattr(self, "decoding", None)
        if getattr(decoding, "batch_sizes", None) and self.job != "evaluate":
            raise ValueError(f"decoding.batch_sizes: only the evaluate job sweeps batch "
                             f"sizes (this is {self.job}); set decoding.batch_size")
        return self

    def dump(self) -> dict:
        """The resolved config as JSON-able data, only the groups this job accepts (a
        sweep leaves out the groups of other sweep kinds), so it loads back as is."""
        data = self.model_dump(mode="json")
        allowed = self.groups(data)
        return {k: v for k, v in data.items() if k in allowed}

    def to_yaml(self) -> str:
        """:meth:`dump` as YAML (what a run logs as ``config.yaml``)."""
        return yaml.safe_dump(self.dump(), sort_keys=False)

    @classmethod
    def from_dict(cls, data: dict, overrides: list[str] | None = None) -> ExperimentConfig:
        """Validate ``data`` (after ``key=value`` overrides) as the config of its job."""
        data = apply_overrides(copy.deepcopy(data or {}), overrides)
        if not isinstance(data, dict):
            raise ConfigError("config: must hold a mapping at the top level")
        own = cls.job_name()
        job = data.setdefault("job", own or DEFAULT_JOB)
        if own is None:
            if not isinstance(job, str) or job not in JOB_CONFIGS:
                raise ConfigError(f"job: unknown job {job!r}; known: {', '.join(JOB_CONFIGS)}")
            model = JOB_CONFIGS[job]
        elif job != own:
            raise ConfigError(f"job: this is a {job!r} config, not a {own!r} one "
                              f"(run it with: python -m jobs.{job} --config ...)")
        else:
            model = cls
        model.precheck(data)
        allowed = model.groups(data)
        unused = [k for k in data if k not in allowed and k in ALL_GROUPS]
        if unused:
            uses = ", ".join(g for g in allowed if g not in _COMMON)
            raise ConfigError("\n".join(
                f"{k}: the {model.job_name()} job does not use a {k!r} group "
                f"(its groups: {uses})" for k in unused))
        try:
            return model.model_validate(data)
        except ValidationError as err:
            raise ConfigError(format_validation_error(err)) from None


def load_experiment(path: str | Path, overrides: list[str] | None = None) -> ExperimentConfig:
    """The config of the job ``path`` names (``job:``), with ``key=value`` overrides."""
    return ExperimentConfig.from_yaml(path, overrides)


class _Methods(ExperimentConfig):
    """Groups of a job that decodes with one ``method`` or several ``methods``."""

    method: MethodConfig = Field(default_factory=default_method)
    methods: list[MethodConfig] = Field(default_factory=list)

    def method_list(self) -> list[MethodSpec]:
        """``methods`` when given, else the single ``method``."""
        return list(self.methods) or [self.method]


class _Evaluates(_Methods):
    """A job that evaluates methods on the ``data`` prompts with Ray actors."""

    models: ModelsConfig = ModelsConfig()
    data: DataConfig = DataConfig()
    decoding: DecodingConfig = DecodingConfig()
    resources: ResourcesConfig = ResourcesConfig()


class _Trains(ExperimentConfig):
    """A job that trains with Ray Train and writes under ``output``."""

    train: TrainConfig = TrainConfig()
    scaling: TrainScalingConfig = TrainScalingConfig()
    output: OutputConfig = OutputConfig()

    @model_validator(mode="after")
    def _resume_needs_name(self):
        if self.train.resume and not self.output.run_name:
            raise ValueError("output.run_name: required when train.resume is true")
        if self.train.precision == "float16" and not self.scaling.use_gpu:
            raise ValueError("train.precision: float16 needs GPUs (scaling.use_gpu: true); "
                             "use bfloat16 on CPU")
        return self


class EvaluateJob(_Evaluates):
    """``jobs.evaluate``: methods vs AR on a prompt set (at each of
    ``decoding.batch_sizes`` when given: :mod:`speclab.pipelines.batch_sweep`)."""

    job: Literal["evaluate"] = "evaluate"
    #: orderings between the methods' rows, by their ``label`` (printed, logged as
    #: ``orderings.csv`` / ``orderings.json`` and ``ordering_<above>_over_<below>``)
    orderings: list[OrderingConfig] = Field(default_factory=list)

    @model_validator(mode="after")
    def _sweep_fits(self):
        sizes = self.decoding.batch_sizes
        if sizes and max(sizes) > self.data.num_prompts:
            raise ValueError(f"decoding.batch_sizes: the largest ({max(sizes)}) exceeds "
                             f"data.num_prompts ({self.data.num_prompts})")
        return self

    @model_validator(mode="after")
    def _orderings_name_rows(self):
        if self.orderings and self.decoding.batch_sizes:
            raise ValueError("orderings: tested on one evaluation's rows; leave "
                             "decoding.batch_sizes unset")
        labels = ["ar", *(m.label for m in self.method_list() if m.label)]
        for i, o in enumerate(self.orderings):
            for side in ("above", "below"):
                if getattr(o, side) not in labels:
                    raise ValueError(
                        f"orderings[{i}].{side}: {getattr(o, side)!r} is no method's label "
                        f"(labels: {labels}); give each ordered method a `label`")
            if o.above == o.below:
                raise ValueError(f"orderings[{i}]: above and below are both {o.above!r}")
        return self


class TrainTargetJob(_Trains):
    """``jobs.train_target``: a LLaMA target on a corpus."""

    job: Literal["train_target"] = "train_target"
    corpus: CorpusConfig = CorpusConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    arch: ArchConfig = ArchConfig()


class DistillJob(_Trains, _Evaluates):
    """``jobs.distill``: target signals -> drafter (``arch``) -> registry -> evaluation."""

    job: Literal["distill"] = "distill"
    corpus: CorpusConfig = CorpusConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    arch: DraftArchConfig = DraftArchConfig()
    distill: DistillConfig = DistillConfig()


class CompareLossesJob(DistillJob):
    """``jobs.compare_losses``: one drafter per ``compare.losses`` entry, same budget."""

    job: Literal["compare_losses"] = "compare_losses"
    compare: CompareConfig = CompareConfig()


#: a method field a trained family fills (``eagle_model``, ...) set to the artifact the
#: job trains (the default in a job that trains the family, Tune trials included)
TRAINED = "trained"


def known_family(name: Any) -> TrainedFamily | None:
    """The family ``name`` when there is one (built-ins first, plugins on a miss)."""
    try:
        return family(name) if isinstance(name, str) else None
    except ValueError:
        return None


def default_trained(data: dict, fam: TrainedFamily | None) -> None:
    """Methods of ``fam``'s method (in ``method`` / ``methods`` of the raw ``data``)
    without its artifact field evaluate the artifact the job trains (``trained``). An
    explicit ``methods: []`` with no ``method`` evaluates the trained artifact with its
    method's defaults, not the chain of :func:`default_method` (which needs a draft model
    the real targets lack, and would fail only once training is done)."""
    if fam is None or fam.method is None:
        return
    methods = data.get("methods")  # anything but a list is refused by validation
    if methods == [] and data.get("method") is None:
        data["method"] = {"name": fam.method}
    entries = [data.get("method")] + (methods if isinstance(methods, list) else [])
    for m in entries:
        if isinstance(m, dict) and m.get("name") == fam.method:
            m.setdefault(fam.artifact_field, TRAINED)


class _TrainsFamily(_Trains, _Evaluates):
    """A job that trains the family :attr:`trains` names (then evaluates ``methods``):
    its methods default to the artifact it trains, and every objective it trains passes
    the objective's own checks against the job (:meth:`objectives`)."""

    trains: ClassVar[str] = ""

    @classmethod
    def family_name(cls, data: dict) -> str | None:
        """The family a raw config trains (the class's own, or a field's)."""
        del data
        return cls.trains

    @classmethod
    def precheck(cls, data: dict) -> None:
        """The family's methods without their artifact field evaluate the trained one."""
        name = cls.family_name(data)
        default_trained(data, known_family(name))

    def objectives(self) -> list[tuple[str, Any]]:
        """(objective, the training group it trains with) of every artifact this job
        trains (none by default)."""
        return []

    @model_validator(mode="after")
    def _objectives_fit(self):
        """Each trained objective's own checks against the job, then the family's."""
        pairs = self.objectives()
        if not pairs:
            return self
        fam = family(self.family_name(self.__dict__))
        for name, group in pairs:
            objective(name, fam.name, f"{fam.train_group}.loss").check_job(group, self)
            if fam.check_job:
                load(fam.check_job)(group, self)
        return self


def check_data_prompt(eagle: EagleTrainConfig, distill: DistillConfig) -> None:
    """ValueError unless ``eagle.data: target`` leaves the target tokens to generate."""
    if eagle.data == "target" and eagle.data_prompt >= distill.seq_len:
        raise ValueError(f"eagle.data_prompt ({eagle.data_prompt}) must be below "
                         f"distill.seq_len ({distill.seq_len}): data: target continues "
                         "each window's first data_prompt tokens")


class DistillEagleJob(_TrainsFamily):
    """``jobs.distill_eagle``: target features -> EAGLE drafter (``eagle``) -> registry ->
    evaluation. Its ``eagle`` methods default to ``eagle_model: trained``, the drafter
    this job trains; methods that need a draft LM use ``models.draft``."""

    job: Literal["distill_eagle"] = "distill_eagle"
    corpus: CorpusConfig = CorpusConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    distill: DistillConfig = DistillConfig()
    eagle: EagleTrainConfig = EagleTrainConfig()
    trains: ClassVar[str] = "eagle"

    def eagle_losses(self) -> list[str]:
        """The EAGLE-family losses this job trains."""
        return [self.eagle.loss]

    def objectives(self) -> list[tuple[str, Any]]:
        return [(self.eagle.loss, self.eagle)]


class CompareEagleJob(DistillEagleJob):
    """``jobs.compare_eagle``: one EAGLE drafter per ``compare.losses`` entry (``eagle``,
    ``hass``, ``talf``) on the same data and budget, evaluated with every method."""

    job: Literal["compare_eagle"] = "compare_eagle"
    compare: EagleCompareConfig = EagleCompareConfig()
    #: top-16 stored by default, so the default HASS K (10) is below it
    distill: DistillConfig = DistillConfig(top_k=16)

    def eagle_losses(self) -> list[str]:
        return [EAGLE_COMPARE_ROWS[row][1] for row in self.compare.losses]

    def objectives(self) -> list[tuple[str, Any]]:
        return [(EAGLE_COMPARE_ROWS[row][1], self.compare.row_eagle(row, self.eagle))
                for row in self.compare.losses]

    @model_validator(mode="after")
    def _rows_train(self):
        for row in self.compare.losses:  # each row's eagle group, EAGLE-3's settings too
            self.compare.row_eagle(row, self.eagle)
        return self


class TrainMedusaJob(_TrainsFamily):
    """``jobs.train_medusa``: the target's self-distillation data -> Medusa heads (each of
    ``medusa.variants``) -> calibration and sparse tree -> registry -> evaluation. Its
    ``medusa`` methods default to ``medusa_model: trained``, the heads this job trains
    (for ``medusa2`` with the jointly trained target)."""

    job: Literal["train_medusa"] = "train_medusa"
    corpus: CorpusConfig = CorpusConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    distill: DistillConfig = DistillConfig()
    medusa: MedusaTrainConfig = MedusaTrainConfig()
    trains: ClassVar[str] = "medusa"

    @model_validator(mode="after")
    def _sequences_longer_than_the_heads_reach(self):
        length = self.distill.prompt_len + self.distill.response_len
        if length <= self.medusa.heads + 1:
            raise ValueError(f"distill.prompt_len + distill.response_len ({length}) must "
                             f"exceed medusa.heads + 1 ({self.medusa.heads + 1}): head k "
                             f"predicts k + 1 tokens ahead")
        return self


class TrainDrafterJob(_TrainsFamily):
    """``jobs.train_drafter``: the generic training job of a trained family named by
    ``family`` (a built-in or one from ``$SPECLAB_PLUGINS``): the target's data kinds the
    family consumes -> the family's task on Ray Train -> its artifact saved, registered
    and evaluated with ``methods``, whose ``<artifact field>`` defaults to it
    (``trained``). ``drafter`` is the family's training group (validated by the class
    its declaration names)."""

    job: Literal["train_drafter"] = "train_drafter"
    family: str = Field("eagle", description="the trained drafter family (speclab.families)")
    corpus: CorpusConfig = CorpusConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    distill: DistillConfig = DistillConfig()
    drafter: dict[str, Any] = Field(default_factory=dict,
                                    description="the family's training group")

    @classmethod
    def family_name(cls, data: dict) -> str | None:
        name = data.get("family", cls.model_fields["family"].default)
        return name if known_family(name) is not None else None

    def __getattr__(self, name: str) -> Any:
        """The typed ``drafter`` group also under the family's own group name
        (``cfg.eagle``), so a family's stages read it as in the family's own job."""
        fam = known_family(self.__dict__.get("family"))
        if fam is not None and name == fam.train_group:
            return self.drafter_config()
        return super().__getattr__(name)

    @field_validator("family")
    @classmethod
    def _known_family(cls, name: str) -> str:
        fam = family(name)
        if fam.save is None:
            raise ValueError(f"family {name!r} declares no 'save' hook, so the generic "
                             f"job cannot write its artifact; train it with "
                             f"jobs.{fam.job or '<its own job>'}")
        return name

    _group: Any = PrivateAttr(None)

    @model_validator(mode="after")
    def _drafter_group(self):
        self.__dict__["drafter"] = self.drafter_config().model_dump(mode="json")
        return self

    def drafter_config(self) -> Any:
        """The typed ``drafter`` group (the family's training-group class): one object
        for the job's lifetime, so what a stage resolves in it (``init_from``) stays."""
        if self._group is None:  # validators of the base classes run first
            self._group = typed_group(family(self.family), self.drafter, "drafter")
        return self._group

    def objectives(self) -> list[tuple[str, Any]]:
        """The objective the ``drafter`` group names (its ``loss``), if it has one."""
        group = self.drafter_config()
        name = getattr(group, "loss", None)
        return [(name, group)] if isinstance(name, str) else []


class TrainRecommenderJob(_Trains):
    """``jobs.train_recommender``: an AtSpeed target (or SFT drafter) on ``rec`` data."""

    job: Literal["train_recommender"] = "train_recommender"
    rec: RecConfig = RecConfig()
    arch: ArchConfig = ArchConfig()


class RecommendEvalJob(_Trains):
    """``jobs.recommend_eval``: AtSpeed Table 1 (targets/drafters trained when absent)."""

    job: Literal["recommend_eval"] = "recommend_eval"
    rec: RecConfig = RecConfig()
    rec_eval: RecEvalConfig = RecEvalConfig()
    arch: ArchConfig = ArchConfig()


class _TrainsHeads(_Trains):
    """Groups of acceptance-head training: accept data generation + the head."""

    models: ModelsConfig = ModelsConfig()
    corpus: CorpusConfig = CorpusConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    distill: DistillConfig = DistillConfig()
    head: HeadConfig = HeadConfig()


class TrainHeadJob(_TrainsHeads):
    """``jobs.train_head``: a SpecDec++ acceptance head for a drafter."""

    job: Literal["train_head"] = "train_head"


class SpecdecppEvalJob(_TrainsHeads):
    """``jobs.specdecpp_eval``: fixed gamma vs acceptance heads x thresholds."""

    job: Literal["specdecpp_eval"] = "specdecpp_eval"
    data: DataConfig = DataConfig()
    decoding: DecodingConfig = DecodingConfig()
    resources: ResourcesConfig = ResourcesConfig()
    adaptive: AdaptiveEvalConfig = AdaptiveEvalConfig()


class BuildDatastoreJob(ExperimentConfig):
    """``jobs.build_datastore``: a REST datastore from a corpus."""

    job: Literal["build_datastore"] = "build_datastore"
    models: ModelsConfig = ModelsConfig()
    corpus: CorpusConfig = CorpusConfig()
    datastore: DatastoreConfig = DatastoreConfig()


class RegenerateJob(ExperimentConfig):
    """``jobs.regenerate``: the target's own answers to the ``corpus`` conversations."""

    job: Literal["regenerate"] = "regenerate"
    models: ModelsConfig = ModelsConfig()
    corpus: CorpusConfig = CorpusConfig(source="conversations", path="sharegpt")
    regenerate: RegenerateConfig = Field(default_factory=RegenerateConfig)


class RetrievalEvalJob(_Methods):
    """``jobs.retrieval_eval``: model-free drafters on context-reuse tasks."""

    job: Literal["retrieval_eval"] = "retrieval_eval"
    models: ModelsConfig = ModelsConfig()
    decoding: DecodingConfig = DecodingConfig()
    resources: ResourcesConfig = ResourcesConfig()
    retrieval: RetrievalEvalConfig = RetrievalEvalConfig()


#: tune: the groups a ``decode`` sweep uses (besides name, job, tracking, ray, sweep)
DECODE_GROUPS = ("models", "data", "decoding", "method", "retrieval", "train", "output")


def tune_groups(kind: str) -> tuple[str, ...]:
    """The groups a ``sweep.kind`` uses: ``decode``'s, or those the trained family of
    that kind declares (:class:`speclab.families.spec.SweepSpec`); an unknown kind gets
    ``decode``'s (``sweep.kind`` itself refuses it)."""
    fam = sweep_kinds(kind).get(kind)
    return fam.sweep.groups if fam is not None else DECODE_GROUPS


def typed_group(fam: TrainedFamily, data: dict, field: str) -> Any:
    """``data`` validated by ``fam``'s training-group class (ValueError naming ``field``)."""
    try:
        return fam.train_config_class().model_validate(data)
    except ValidationError as err:
        raise ValueError("; ".join(f"{'.'.join(map(str, loc))}: {msg}"
                                   for loc, msg in error_lines(err, (field,)))) from None


def _swept_values(domain) -> list | None:
    """The values a raw ``sweep.space`` entry takes (grid or choice), else None."""
    if isinstance(domain, dict):
        for kind in ("grid", "choice"):
            if isinstance(domain.get(kind), list):
                return domain[kind]
    return None


class TuneJob(_Trains):
    """``jobs.tune``: a Ray Tune sweep over dotted paths of this config. Which groups
    it takes depends on ``sweep.kind`` (:func:`tune_groups`): ``decode`` evaluates
    ``method``; ``train_head`` trains a head per trial; ``atspeed`` an AtSpeed drafter
    (``rec_eval.draft_loss`` / ``rec_eval.align_alpha``); ``eagle`` an EAGLE-family
    drafter (the ``eagle`` group: loss, HASS K / steps / weights, TALF trees), then
    evaluates ``method`` (``name: eagle``) with it."""

    job: Literal["tune"] = "tune"
    sweep: SweepConfig | None = None  # required by the job; trial configs drop it
    models: ModelsConfig = ModelsConfig()
    data: DataConfig = DataConfig()
    decoding: DecodingConfig = DecodingConfig()
    method: MethodConfig = Field(default_factory=default_method)
    retrieval: RetrievalEvalConfig = RetrievalEvalConfig()
    corpus: CorpusConfig = CorpusConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    distill: DistillConfig = DistillConfig()
    head: HeadConfig = HeadConfig()
    eagle: EagleTrainConfig = EagleTrainConfig()
    rec: RecConfig = RecConfig()
    rec_eval: RecTrialConfig = RecTrialConfig()
    arch: ArchConfig = ArchConfig()
    drafter: dict[str, Any] = Field(default_factory=dict, description=(
        "the training group of a family from a plugin whose sweep kind this is (its "
        "declaration's train_config validates it)"))

    _method_knobs: dict | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _eagle_windows(self):
        check_data_prompt(self.eagle, self.distill)
        return self

    @model_validator(mode="wrap")
    @classmethod
    def _swept_method_names(cls, data, handler):
        """With ``method.name`` swept, ``method`` may carry every swept method's knobs."""
        raw = None
        if (isinstance(data, dict) and isinstance(data.get("sweep"), dict)
                and "method.name" in (data["sweep"].get("space") or {})
                and isinstance(data.get("method"), dict)):
            raw = data["method"]
            data = {**data, "method": own_method_knobs(raw)}
        obj = handler(data)
        if raw is not None:
            obj._method_knobs = dict(raw)
        return obj

    @classmethod
    def precheck(cls, data: dict) -> None:
        """A swept ``method.<knob>`` must be a knob of every method the sweep evaluates
        (``method.name``'s swept values, else the config's method): a knob a method lacks
        would give identical trials (checked first: with ``method.name`` swept the base
        ``method`` may hold several methods' knobs). In a sweep of a trained family's
        trials, the family's method field (``method.eagle_model``) defaults to
        ``trained``: each trial's artifact."""
        from speclab.config.method import methods

        sweep = data.get("sweep")
        method = data.get("method")
        kind = sweep.get("kind") if isinstance(sweep, dict) else None
        if isinstance(kind, str):
            default_trained(data, sweep_kinds(kind).get(kind))  # each trial's own artifact
        space = sweep.get("space") if isinstance(sweep, dict) else None
        if not isinstance(space, dict):
            return
        known = methods()
        knobs = {k for c in known.values() for k in c.model_fields}
        names = _swept_values(space.get("method.name"))
        if names is None:
            names = [method.get("name", "chain") if isinstance(method, dict) else "chain"]
        for path in space:
            head, _, knob = str(path).partition(".")
            if head != "method" or not knob or knob == "name":
                continue
            if knob not in knobs:
                raise ConfigError(f"sweep.space: {path!r} is not a field of the config "
                                  f"(method knobs: {', '.join(sorted(knobs))})")
            for name in names:  # a knob some swept method lacks: its trials would repeat
                cls = known.get(name) if isinstance(name, str) else None
                if cls is not None and knob not in cls.model_fields:
                    own = sorted(k for k in cls.model_fields if k not in cls.META)
                    raise ConfigError(
                        f"sweep.space: {path!r}: {knob} is not a knob of method {name!r} "
                        f"(its knobs: {', '.join(own) or 'none'}), so its trials would all "
                        f"be the same; sweep that method's own knobs in a sweep of its own")

    @model_validator(mode="after")
    def _device_follows_trial_gpus(self):
        """An explicit ``sweep.trial_gpus`` agrees with ``models.device`` as a Serve
        deployment's ``num_gpus`` does (:func:`device_for_gpus`); a CPU-only family's
        trials (AtSpeed's: the recommendation groups have no device) run on the CPU."""
        gpus = self.sweep.trial_gpus if self.sweep is not None else None
        if gpus is None:
            return self
        fam = sweep_kinds(self.sweep.kind).get(self.sweep.kind)
        if fam is not None and fam.sweep.cpu_only and gpus > 0:
            raise ValueError(f"sweep.trial_gpus is {gpus:g} but an {self.sweep.kind} sweep's "
                             "trials run on the CPU (the rec groups have no device); leave "
                             "it out")
        device_for_gpus(self.models.device, gpus, "sweep.trial_gpus", "each trial")
        return self

    @model_validator(mode="after")
    def _family_sweep(self):
        """A trained family's sweep: its ``drafter`` group (a family from a plugin) is
        valid, and the family's own checks of a sweep config hold."""
        fam = sweep_kinds(self.sweep.kind).get(self.sweep.kind) if self.sweep else None
        if fam is None:
            return self
        if fam.train_group == "drafter":
            self.__dict__["drafter"] = typed_group(  # no re-validation on assignment
                fam, self.drafter, "drafter").model_dump(mode="json")
        if fam.sweep.validate:
            load(fam.sweep.validate)(self)
        return self

    def sweep_base(self) -> dict:
        """The JSON dump trials start from (``method`` with every swept method's knobs)."""
        base = self.model_dump(mode="json")
        if self._method_knobs:
            base["method"] = {**base["method"], **self._method_knobs}
        return base

    @classmethod
    def groups(cls, data: dict | None = None) -> tuple[str, ...]:
        sweep = (data or {}).get("sweep")
        if sweep is None:  # one trial's config (speclab.sweep.trial_config): every group
            return tuple(cls.model_fields)
        kind = sweep.get("kind", "decode") if isinstance(sweep, dict) else "decode"
        if not isinstance(kind, str):  # a bad kind (a list...) is refused by its field
            kind = "decode"
        return (*_COMMON, "sweep", *tune_groups(kind))

    def method_list(self) -> list[MethodSpec]:
        return [self.method]


class ServeJob(ExperimentConfig):
    """``speclab serve`` / ``serve_apps.app``: target + draft deployments and ingress."""

    job: Literal["serve"] = "serve"
    models: ModelsConfig = ModelsConfig()
    method: MethodConfig = Field(default_factory=default_method)
    serve: ServeConfig = ServeConfig()

    @model_validator(mode="after")
    def _one_budget(self):
        """A served method's budget is ``serve.budget`` (per request, on the replica's
        batch), not the method group's."""
        if self.method.budget is not None:
            raise ValueError(f"method.budget: in Serve the budget is serve.budget "
                             f"(set serve.budget: {self.method.budget} instead)")
        return self

    @model_validator(mode="after")
    def _device_follows_gpus(self):
        """A deployment's device follows its ``num_gpus`` (``models.device: auto`` picks
        cuda for a deployment with GPUs, cpu without); an explicit device that
        contradicts them is refused: GPUs reserved and idle, or a GPU used unreserved."""
        for name in ("target", "draft"):
            self.device_of(name)
        return self

    def device_of(self, deployment: str) -> str:
        """The device a deployment's model loads on (``target`` / ``draft``)."""
        return device_for_gpus(self.models.device, getattr(self.serve, deployment).num_gpus,
                               f"serve.{deployment}.num_gpus")


JOB_CONFIGS: dict[str, type[ExperimentConfig]] = {
    c.model_fields["job"].default: c
    for c in (EvaluateJob, TrainTargetJob, DistillJob, CompareLossesJob, DistillEagleJob,
              CompareEagleJob, TrainMedusaJob, TrainDrafterJob, TrainRecommenderJob,
              RecommendEvalJob, TrainHeadJob, SpecdecppEvalJob, BuildDatastoreJob,
              RetrievalEvalJob, RegenerateJob, TuneJob, ServeJob)
}
ALL_GROUPS: frozenset[str] = frozenset(g for c in JOB_CONFIGS.values() for g in c.model_fields)

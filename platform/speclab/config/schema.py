"""The config GROUPS every job config is made of (one pydantic model per group).

``models`` (which target/draft), ``data`` (prompt set), ``decoding`` (sampling settings
shared by all methods), ``method`` / ``methods`` (the method registry's configs),
``resources`` (Ray actors), ``tracking`` (MLflow), ``ray`` (cluster address); training
groups ``corpus``, ``tokenizer``, ``arch``, ``train``, ``scaling`` (Ray Train workers)
and ``output``; job-specific groups (``distill``, ``compare``, ``rec``, ``rec_eval``,
``head``, ``adaptive``, ``datastore``, ``retrieval``, ``sweep``, ``serve``).
Which job uses which groups: :mod:`speclab.config.jobs`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from speclab.config.base import StrictModel
from speclab.config.method import MethodConfig, parse_method
from speclab.families.objectives import objective, objectives
from speclab.families.registry import sweep_kinds


class ModelsConfig(StrictModel):
    """``target``/``draft``: a folder, a hub id, ``reference`` (the trained reference pair,
    built on first use) or ``tiny`` (random tiny models with a real tokenizer, for smoke
    runs). ``draft`` defaults to the partner of a ``reference``/``tiny`` target.
    ``dtype`` defaults to float32, but for ``reference-large`` to its
    :func:`~speclab.reference_large.run_dtype` on ``device`` (bfloat16 where it is native),
    as ``speclab bench`` runs it."""

    target: str = "reference"
    draft: str | None = None
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    device: str = Field("cpu", pattern=r"^(cpu|auto|cuda(:\d+)?)$")
    attn_implementation: Literal["auto", "sdpa", "eager"] = Field(
        "auto", description="auto: sdpa where the model supports it, else eager")

    @model_validator(mode="before")
    @classmethod
    def _large_runs_in_its_dtype(cls, data: Any) -> Any:
        # measured on a 2-core AVX512-BF16 VM (2026-12-06): 4 new tokens cost 1.90x one
        # in float32 (143.6 against 75.5 ms: compute-bound), 1.12x in bfloat16 (78.0
        # against 69.8 ms); an evaluate job that loaded it in float32 (the old default)
        # ran chain gamma=3 at 1.03x plain decoding and every chain below plain at batch 2
        if (isinstance(data, dict) and data.get("target") == "reference-large"
                and data.get("dtype") is None):
            from speclab.reference_large import run_dtype

            device = data.get("device", "cpu")
            data = {**data, "dtype": run_dtype(device if isinstance(device, str) else "cpu")}
        return data


class DataConfig(StrictModel):
    """Prompt set: function headers from the stdlib test split, a JSONL file of prompts
    (``prompt``, optional ``category``), held-out ``conversations`` (the test split of
    a conversation source, by the corpus's hash of the id), or ``questions`` (MT-bench /
    Spec-Bench ``question.jsonl``: ``question_id``, ``category``, ``turns``). The chat
    kinds (and ``jsonl`` with ``chat: true``) are rendered with the target's chat
    template; tables, JSON and MLflow then give every figure per category too."""

    prompts: Literal["stdlib_functions", "jsonl", "conversations", "questions"] = \
        "stdlib_functions"
    path: str | None = None
    num_prompts: int = Field(16, gt=0)
    context_chars: int = Field(300, gt=0)
    seed: int = 0
    turns: int = Field(1, ge=1, le=2, description=(
        "conversations / questions: 2 adds each second user turn, after the target's own "
        "greedy answer to the first (as MT-bench does)"))
    chat: bool = Field(False, description="jsonl: render each prompt as a user message "
                                          "through the chat template")
    chat_template: str | None = Field(None, description=(
        "a Jinja chat template (text or a file) for a target whose tokenizer has none"))

    @model_validator(mode="after")
    def _path_for_jsonl(self):
        if self.prompts != "stdlib_functions" and not self.path:
            raise ValueError(f"path is required when prompts is {self.prompts!r}")
        return self


class DecodingConfig(StrictModel):
    """Sampling settings shared by every method of a run."""

    renamed = {"top_k_sampling": "sample_top_k"}

    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    sample_top_k: int = Field(0, ge=0, description="top-k filter of the sampler (0: off)")
    max_new_tokens: int = Field(64, gt=0)
    seed: int = 0
    batch_size: int = Field(1, gt=0, description="prompts decoded together by the batched "
                                                 "engine (1: one at a time); AR is timed at "
                                                 "the same batch size")
    batch_sizes: list[int] | None = Field(None, description=(
        "evaluate only: a batch-size sweep instead of one batch_size: every method at each "
        "size (AR timed at the same size), then per size plain decoding, the best fixed "
        "method and each budget: auto method (table batch_sweep.txt / .json, plot "
        "batch_scaling.png)"))
    timing_passes: int = Field(3, ge=1, le=100, description=(
        "timed passes of the paired protocol (each method paired with AR per prompt, or "
        "per pass over the batch; speedup: the median paired ratio with a 95% interval; "
        "speclab.evaluation.TIMING_PASSES); tau and acceptance come from the first"))
    verify: str | None = Field(None, description="a rule of the rule registry "
                                                 "(speclab.decoding.rules; default: greedy "
                                                 "at temperature 0, sample otherwise)")
    verify_params: dict[str, Any] | None = Field(
        None, description="the rule's parameters (its params model), e.g. typical: "
                          "{epsilon, delta}")

    def generate_kwargs(self) -> dict:
        """The ``Decoder.generate`` / timing-protocol keywords: every field but
        ``batch_sizes`` (the evaluate job's sweep, which sets ``batch_size`` per size)."""
        return self.model_dump(exclude={"batch_sizes"})

    @field_validator("batch_sizes")
    @classmethod
    def _sizes(cls, v: list[int] | None) -> list[int] | None:
        """Sizes >= 1, at least one; sorted, each once."""
        if v is not None and (not v or any(s < 1 for s in v)):
            raise ValueError(f"need a list of batch sizes >= 1, got {v}")
        return sorted(set(v)) if v is not None else None

    @field_validator("verify")
    @classmethod
    def _registered_rule(cls, v: str | None) -> str | None:
        """A name of the rule registry (plugin rules included), not a fixed list."""
        if v is not None:
            from speclab.decoding.rules.registry import get_rule

            try:
                get_rule(v)
            except ValueError as err:  # "verify: must be one of ..." -> the field's own path
                raise ValueError(str(err).removeprefix("verify: ")) from None
        return v

    @model_validator(mode="after")
    def _rule_params(self):
        """The rule and its ``verify_params`` checked now, not at the first prompt."""
        if self.verify is not None or self.verify_params is not None:
            from speclab.decoding.rules import resolve_rule
            from speclab.decoding.sampling import SamplingParams

            resolve_rule(self.verify, self.verify_params, SamplingParams(
                self.temperature, self.sample_top_k, self.top_p))
        return self


class ResourcesConfig(StrictModel):
    """Ray actors that hold the models (fractional CPUs allowed)."""

    num_actors: int = Field(1, gt=0)
    num_cpus_per_actor: float = Field(1.0, gt=0.0)
    num_gpus_per_actor: float = Field(0.0, ge=0.0)
    torch_threads: int | None = Field(None, gt=0, description=(
        "torch CPU threads of each evaluation actor (None: Ray's default, one per "
        "reserved CPU). On the reference pair 1 is faster and steadier: with 2 threads a "
        "forward waits at its barrier whenever another process (Ray's own daemons) wakes "
        "on a core"))


class TrackingConfig(StrictModel):
    """MLflow: ``uri`` None -> ``$MLFLOW_TRACKING_URI`` or the embedded SQLite store."""

    enabled: bool = True
    uri: str | None = None
    experiment: str = "speclab"
    run_name: str | None = Field(None, description="the parent run's name (None: "
                                 "output.run_name where the job has one, else the "
                                 "config's name)")


class RayConfig(StrictModel):
    """``address`` None -> ``$RAY_ADDRESS`` or an embedded local Ray."""

    address: str | None = None
    num_cpus: int | None = Field(None, gt=0, description="CPUs of an embedded Ray")


class CorpusConfig(StrictModel):
    """Training text: the stdlib (default), a folder of text files, a JSONL file (field
    ``text_field``), a Hugging Face dataset id (``hf_dataset``, needs a hub), or
    ``conversations``: chat data rendered with the target's chat template, the loss on
    assistant tokens only (``path``: a ShareGPT JSON / JSONL file, OpenAI-messages JSONL,
    a saved dataset folder, a regeneration job's output folder, or the built-in name
    ``sharegpt``)."""

    source: Literal["stdlib", "text_folder", "jsonl", "hf_dataset", "conversations"] = "stdlib"
    path: str | None = None
    text_field: str = "text"
    max_chars: int = Field(4_000_000, gt=0)
    val_chars: int = Field(200_000, gt=0)
    format: Literal["auto", "sharegpt_json", "jsonl", "hf_disk", "regenerated"] = Field(
        "auto", description="conversations: the file's format (auto: by its first record)")
    strict: bool = Field(False, description=(
        "conversations: refuse a malformed record (naming its line / record) instead of "
        "skipping and counting it"))
    chat_template: str | None = Field(None, description=(
        "conversations: a Jinja chat template (text or a file) for a target whose "
        "tokenizer has none"))
    max_conversations: int | None = Field(2000, gt=0, description=(
        "conversations: at most this many of the split are rendered (null: all)"))
    shard_tokens: int = Field(1 << 20, ge=1024, description=(
        "conversations: tokens per shard of the tokenised corpus (written once under "
        "$SPECLAB_HOME/data/tokens, memory-mapped by later runs)"))
    validation: float = Field(0.02, ge=0.0, lt=0.5, description=(
        "conversations: the fraction held out for validation (by a hash of the id)"))
    test: float = Field(0.02, ge=0.0, lt=0.5, description=(
        "conversations: the fraction held out for evaluation prompts"))

    @model_validator(mode="after")
    def _path_needed(self):
        if self.source != "stdlib" and not self.path:
            raise ValueError(f"path is required when source is {self.source!r}")
        return self


class RegenerateConfig(StrictModel):
    """The regeneration job: the target answers the user turns of the ``corpus``
    conversations itself (what EAGLE, Medusa and SpecForge train on)."""

    split: Literal["train", "validation", "test"] = "train"
    turns: int = Field(2, gt=0, description="user turns answered per conversation (the "
                                            "conversation ends after the last one)")
    max_new_tokens: int = Field(256, gt=0, description="token cap of one answer")
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int = 0
    method: MethodConfig = Field(default_factory=lambda: parse_method({"name": "ar"}),
                                 description=(
        "the decoding method of the batched engine ({name: ar}: plain decoding; a "
        "drafting method speeds the job up and never changes its outputs at T=0)"))
    batch_size: int = Field(8, gt=0, description="conversations decoded together")
    shard_size: int = Field(64, gt=0, description="conversations per output shard")
    order: Literal["length", "source"] = Field("length", description=(
        "how conversations are cut into shards: 'length' (by the characters of their "
        "first user turn, so a batch holds prompts of like length and no short prompt "
        "decodes over a long one's padded cache) or 'source' (as read)"))
    actors: int = Field(1, gt=0)
    cpus_per_actor: float = Field(1.0, gt=0.0)
    gpus_per_actor: float = Field(0.0, ge=0.0)
    output: str | None = Field(None, description=(
        "the output folder (default $SPECLAB_HOME/data/regenerated/<name>); a rerun "
        "keeps its finished shards"))

class TokenizerConfig(StrictModel):
    """``path`` reuses a saved tokenizer; otherwise byte-level BPE is trained."""

    path: str | None = None
    vocab_size: int = Field(1024, ge=300)
    train_chars: int = Field(2_000_000, gt=0)


class ArchConfig(StrictModel):
    """LLaMA architecture of a trained model."""

    layers: int = Field(4, gt=0)
    hidden: int = Field(128, gt=0)
    heads: int = Field(4, gt=0)
    context: int = Field(1024, gt=0)

    @model_validator(mode="after")
    def _heads_divide_hidden(self):
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        return self


class DraftArchConfig(ArchConfig):
    """A distilled drafter's architecture: a LLaMA of ``layers``/``hidden``/``heads``
    initialised at random, or, with ``init_from``, a model of the same tokenizer cut to
    its first ``layers`` decoder layers (:mod:`speclab.models.pruned`): its embeddings,
    those layers, final norm and LM head, in its own architecture, which replaces
    ``hidden``, ``heads`` and ``context``."""

    init_from: str | None = Field(None, description=(
        "`target` (the job's target) or a model folder / models:/ URI of the target's "
        "vocabulary whose first `layers` layers initialise the drafter"))

    @model_validator(mode="after")
    def _cut_sets_the_shape(self):
        if self.init_from is None:
            return self
        errors = [(["init_from"], "empty; give `target` or a model folder")] \
            if not self.init_from.strip() else []
        # compared with the defaults, not with the fields a YAML set: a task config's JSON
        # dump (what Ray Train workers re-validate) holds every field
        fields = type(self).model_fields
        errors += [([name], f"comes from init_from's model ({self.init_from}); leave it out")
                   for name in ("context", "heads", "hidden")
                   if getattr(self, name) != fields[name].default]
        if errors:  # "nested": each message keeps its field's dotted path
            raise PydanticCustomError("nested", "{detail}", {
                "detail": "; ".join(f"{loc[0]}: {m}" for loc, m in errors), "errors": errors})
        return self


class TrainConfig(StrictModel):
    """Optimisation of a Ray Train job (``batch_size`` is per worker)."""

    steps: int = Field(200, gt=0)
    batch_size: int = Field(16, gt=0)
    seq_len: int = Field(128, gt=1)
    lr: float = Field(3e-3, gt=0)
    warmup: int = Field(20, ge=0)
    report_every: int = Field(20, gt=0, description="steps between report + checkpoint")
    val_windows: int = Field(16, gt=0)
    seed: int = 0
    resume: bool = Field(False, description="continue the run named output.run_name")
    max_failures: int = Field(2, ge=0, description="worker-group restarts (FailureConfig)")
    precision: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="mixed precision: the loss under torch.autocast in this dtype "
                               "(weights and optimizer stay float32); float16 (with a "
                               "GradScaler) needs GPUs, bfloat16 runs on CPU too")


class TrainScalingConfig(StrictModel):
    """Ray Train ``ScalingConfig``: DDP over gloo on CPU, NCCL with GPUs."""

    num_workers: int = Field(2, gt=0)
    use_gpu: bool = False
    cpus_per_worker: float = Field(1.0, gt=0)


class OutputConfig(StrictModel):
    """Where a training job writes (checkpoints, data, the final model), what it
    registers in the MLflow Model Registry, and which public formats the final drafter
    is also exported to (``export``: EAGLE-1/2 / HASS drafters to ``eagle``, EAGLE-3
    drafters to ``speculators`` or ``eagle``, train_medusa heads to ``medusa``; each
    export is a folder beside the drafter, logged as an MLflow artifact
    ``export/<format>``)."""

    storage_path: str | None = Field(None, description="default $SPECLAB_HOME/runs")
    run_name: str | None = Field(None, description="default <name>-<timestamp>")
    register_as: str | None = Field(None, description="registered model name")
    export: list[Literal["speculators", "eagle", "medusa"]] = Field(
        default_factory=list, description="formats the final drafter is exported to")

    @field_validator("export")
    @classmethod
    def _once_each(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"each format at most once, got {v}")
        return v


class DistillConfig(StrictModel):
    """Drafter distillation: what the target generates and which loss trains the drafter.

    ``loss`` is a name from the loss registry (built-ins ``sft``, ``word_kd``, ``seq_kd``,
    ``tvd_kd``, ``hass_topk``, ``talf``; more with :func:`speclab.losses.register_loss`)
    or a weighted mix ``{name: weight}``.
    """

    loss: str | dict[str, float] = "word_kd"
    top_k: int = Field(8, gt=0, description="target probabilities kept per position/node")
    hass_k: int | None = Field(None, gt=0, description="HASS top-K (<= top_k)")
    examples: int = Field(256, gt=0, description="generated examples per kind")
    shard_size: int = Field(64, gt=0)
    seq_len: int = Field(64, gt=1, description="window length of kd/sft examples")
    prompt_len: int = Field(32, gt=0)
    response_len: int = Field(32, gt=0)
    context_len: int = Field(48, gt=1)
    tree_top_k: int = Field(4, gt=0)
    tree_depth: int = Field(4, gt=0)
    tree_nodes: int = Field(16, gt=0)
    gen_actors: int = Field(2, gt=0)
    gen_cpus_per_actor: float = Field(0.5, gt=0)
    gen_gpus_per_actor: float = Field(0.0, ge=0)

    @field_validator("loss")
    @classmethod
    def _known_losses(cls, loss: str | dict[str, float]) -> str | dict[str, float]:
        from speclab.losses import registered_losses, unknown_losses

        names = [loss] if isinstance(loss, str) else list(loss)
        unknown = unknown_losses(names)  # built-ins, then plugins ($SPECLAB_PLUGINS)
        if unknown:
            raise ValueError(f"unknown loss {unknown}; known: {sorted(registered_losses())}")
        if isinstance(loss, dict) and not any(w > 0 for w in loss.values()):
            raise ValueError("a loss mix needs at least one positive weight")
        return loss

    @model_validator(mode="after")
    def _hass_k_fits(self):
        if self.hass_k is not None and self.hass_k > self.top_k:
            raise ValueError(f"hass_k ({self.hass_k}) must not exceed top_k ({self.top_k})")
        return self

    def loss_weights(self) -> dict[str, float]:
        """``{loss name: weight}`` (a single loss has weight 1)."""
        if isinstance(self.loss, str):
            return {self.loss: 1.0}
        return {k: float(v) for k, v in self.loss.items() if v > 0}


class EagleTrainConfig(StrictModel):
    """The EAGLE feature drafter ``distill_eagle`` trains (see
    :mod:`speclab.families.eagle.training`):
    ``layers`` decoder layers over the target's features; ``loss`` ``eagle`` (SmoothL1
    feature regression + ``w_cls`` CE), ``hass`` (the same plus ``w_topk`` times top-
    ``hass_k`` distillation, over ``hass_steps`` steps of harmonized context alignment,
    fed-back features detached (``hass_detach``) and step losses summed (``hass_reduce``),
    as in HASS) or ``talf`` (cross-entropy over target-built beam trees of ``talf_top_k`` x
    ``talf_depth`` rooted at every position, the drafter fed its own features; no
    regression term, as in the paper). ``eagle`` and ``hass`` add EAGLE's uniform
    ``feature_noise`` to the features the drafter reads in training.
    ``init_from`` starts from a trained EAGLE drafter (a folder or ``models:/`` URI), the
    TALF/HASS papers' protocol of fine-tuning an EAGLE-trained drafter. ``data: target``
    trains on the target's own text: each window keeps its first ``data_prompt`` corpus
    tokens and the target continues them greedily to the window's length (past EOS, so
    windows keep one length), as EAGLE-3 trainers regenerate their data with the target;
    every position is trained, the kept prefix too.

    ``version: 3`` trains an EAGLE-3 drafter (:mod:`speclab.families.eagle.model3`): fused features
    of the target's ``feature_layers`` (None: the paper's low / middle / high), one
    EAGLE-3 layer, an optional ``draft_vocab`` (the most frequent target tokens of the
    training data), with loss ``eagle3`` (EAGLE-3's training-time test: the drafter's own
    outputs fed back for ``ttt_steps`` steps, the steps' cross-entropies weighted
    ``ttt_decay ** step``; no feature regression) or ``talf``."""

    version: Literal[1, 3] = Field(1, description="1: EAGLE-1/2 drafter (EAGLE, HASS, TALF); "
                                                  "3: EAGLE-3")
    feature_layers: list[int] | None = Field(None, min_length=1, description=(
        "EAGLE-3: the target hidden states fused (HF output_hidden_states indices; None: "
        "(2, L // 2, L - 3) as in the paper)"))
    draft_vocab: int = Field(0, ge=0, description="EAGLE-3: draft vocabulary size (0: the "
                                                  "target's whole vocabulary)")
    ttt_steps: int = Field(7, gt=0, description="eagle3: training-time test steps (the "
                                                "paper's 7)")
    ttt_decay: float = Field(0.8, gt=0.0, le=1.0, description="eagle3: step s weighs "
                                                              "ttt_decay ** (s - 1)")
    eagle3_teacher: Literal["draft_vocab", "topk"] | None = Field(None, description=(
        "eagle3: draft_vocab, EAGLE-3's teacher (the target's whole distribution "
        "renormalised over the draft vocabulary, positions whose target argmax lies "
        "outside it masked; needs features: online) or topk (the stored top-k "
        "restricted to the draft vocabulary and renormalised, no mask: a variant); null: "
        "draft_vocab with online features, topk with offline ones"))
    layers: int = Field(1, gt=0, description="decoder layers of the drafter")
    norms: bool = Field(True, description="speclab's layout: an RMS norm at layer 0's input "
                                          "and before the LM head; false: EAGLE-1/2's "
                                          "(neither), which the EAGLE research format "
                                          "holds (output.export: eagle; speculators holds "
                                          "EAGLE-3 drafters only)")
    loss: str = Field("eagle", description="the objective (speclab.families.eagle.objectives: "
                                          "eagle, hass, talf, eagle3)")
    w_reg: float = Field(1.0, ge=0.0, allow_inf_nan=False,
                         description="weight of the feature regression (eagle, hass)")
    w_cls: float = Field(0.1, ge=0.0, allow_inf_nan=False,
                         description="weight of the token classification term (eagle, hass)")
    w_topk: float = Field(1.0, ge=0.0, allow_inf_nan=False,
                          description="weight of HASS's top-K distillation term (hass)")
    hass_k: int = Field(10, gt=0, description="HASS top-K (<= distill.top_k)")
    hass_steps: int = Field(3, gt=0, description="HASS context-alignment steps n")
    hass_detach: bool = Field(True, description="hass: detach the fed-back features, as "
                                                "HASS does (False: keep their graph)")
    hass_reduce: Literal["sum", "mean"] = Field("sum", description="hass: sum the steps' "
                                                "losses, as HASS does, or average them")
    feature_noise: float = Field(0.2, ge=0.0, allow_inf_nan=False,
                                 description="eagle, hass: EAGLE's uniform noise on the "
                                             "features read in training, (U - 0.5) * "
                                             "feature_noise * feature_noise_len / L (0: none)")
    feature_noise_len: int = Field(512, gt=0, description="the noise's reference length "
                                                          "(512 in EAGLE's and HASS's code)")
    talf_top_k: int = Field(4, gt=0, description="TALF training trees: children kept per "
                                                  "depth (the beam width k)")
    talf_depth: int = Field(3, gt=0, description="TALF training trees: depth")
    talf_roots: int = Field(0, ge=0, description="TALF trees per window and step, drawn at "
                                                 "random (0: every position's)")
    talf_data_roots: int = Field(0, ge=0, description=(
        "TALF data: trees the target builds per window, rooted at positions drawn at random "
        "when the shards are made (0: one at every position); the tree forwards cost in "
        "proportion (a SmolLM2 window of 256 with every root: about 12 s on 2 cores), and "
        "talf_roots then draws among them"))
    init_from: str | None = Field(None, description="start from this EAGLE drafter (folder "
                                                    "or models:/ URI) instead of scratch")
    data: Literal["corpus", "target"] = Field("corpus", description=(
        "the text of the feature windows: corpus windows (EAGLE-1/2's and HASS's fixed "
        "data) or target: each window's first data_prompt tokens continued by the "
        "target's greedy decoding (the data EAGLE-3 trainers regenerate with the target)"))
    data_prompt: int = Field(16, gt=0, description="data: target: corpus tokens kept at the "
                                                   "start of each window")
    engine_prompts: int = Field(4, ge=0, description="held-out prompts the engine decodes "
                                                       "at every report (0: none)")
    engine_tokens: int = Field(32, gt=0, description="greedy tokens per engine prompt")
    features: Literal["offline", "online"] = Field("offline", description=(
        "offline: the target's features and top-k stored in Parquet shards generated on "
        "Ray actors (feat / feat3); online: only the token windows are stored and the "
        "frozen target computes them inside each training step on the worker's device, "
        "as SpecForge's online mode (no feature cache; not for talf, whose trees are "
        "generated offline)"))
    online_top_k: int = Field(8, gt=0, description=(
        "online: the target probabilities kept per position (offline: distill.top_k)"))

    @field_validator("loss")
    @classmethod
    def _known_objective(cls, name: str) -> str:
        objective(name, "eagle", "unknown objective")  # ValueError listing the known ones
        return name

    @property
    def teacher(self) -> str:
        """EAGLE-3's teacher in use: ``eagle3_teacher``, else ``draft_vocab`` with online
        features and ``topk`` with offline ones."""
        return self.eagle3_teacher or ("draft_vocab" if self.features == "online" else "topk")

    @model_validator(mode="after")
    def _version_fits(self):
        objective(self.loss, "eagle", "loss").check_group(self)  # what the objective trains
        if self.version == 3:
            if self.layers != 1:
                raise ValueError(f"layers: an EAGLE-3 drafter has one layer, got {self.layers}")
            if self.eagle3_teacher == "draft_vocab" and self.features == "offline":
                raise ValueError("eagle3_teacher: draft_vocab reads the target's whole "
                                 "distribution in the training step; set features: online "
                                 "(or eagle3_teacher: topk, the stored top-k)")
        else:
            for field in ("feature_layers", "draft_vocab", "eagle3_teacher"):
                if getattr(self, field):
                    raise ValueError(f"{field}: an EAGLE-3 setting; set eagle.version: 3")
        return self


class MedusaTrainConfig(StrictModel):
    """The Medusa heads ``train_medusa`` trains (see
    :mod:`speclab.families.medusa.training`): ``heads``
    heads, each variant in ``variants`` on the same self-distillation data: ``medusa1``
    (frozen backbone, loss ``sum_k decay^k CE_k``) and ``medusa2`` (joint fine-tuning,
    ``L_LM + lambda0 * L_MEDUSA-1``, the backbone frozen for ``heads_warmup`` steps, then
    trained at ``backbone_lr_scale`` times ``train.lr``). After training the heads'
    top-``calibration_top`` accuracies are measured on the target's own tokens (labels
    inside prompts are skipped, as Medusa does) and the ``sparse_nodes``-node sparse
    tree built from them is stored with the heads. ``calibration``: ``prompts`` (the
    default) continues ``calibration_prompts`` held-out prompts of the evaluation's kind
    (``data``: the last function headers of the test split's prompt sequence, or the
    JSONL file's prompts after the evaluated ones; never the evaluated ones) greedily
    for ``decoding.max_new_tokens`` tokens, stopping at EOS, so the expected tau
    describes the decoding the heads will do; ``shard`` scores the held-out training
    shard (corpus windows continued for ``distill.response_len`` tokens, past EOS too:
    more predictable than real prompts, so its expected tau runs high). The heads' loss
    skips the prompts' labels too unless ``prompt_labels``."""

    heads: int = Field(4, gt=0, description="Medusa heads K")
    variants: list[str] = Field(
        default_factory=lambda: ["medusa1"], min_length=1,
        description="the objectives (speclab.families.medusa.objectives: medusa1, medusa2)")
    decay: float = Field(0.8, gt=0.0, le=1.0, description="lambda_k = decay^k")
    lambda0: float = Field(0.2, gt=0.0, allow_inf_nan=False,
                           description="MEDUSA-2: weight of the heads' loss")
    lm_loss: Literal["kl", "ce"] = Field("kl", description="MEDUSA-2 L_LM: kl (from the "
                                                           "original's top-k + rest) or ce")
    heads_warmup: int = Field(0, ge=0, description="MEDUSA-2: steps training heads only")
    backbone_lr_scale: float = Field(0.25, gt=0.0, le=1.0,
                                     description="MEDUSA-2: backbone lr / train.lr")
    prompt_labels: bool = Field(False, description="also train the heads on labels inside "
                                                   "the corpus prompts (Medusa masks them)")
    calibration: Literal["prompts", "shard"] = Field(
        "prompts", description="what the heads are calibrated on: held-out prompts of the "
                               "evaluation's kind, or the held-out training shard")
    calibration_prompts: int = Field(32, gt=0, description="held-out prompts continued "
                                                           "for calibration: 'prompts'")
    calibration_top: int = Field(10, gt=0, description="ranks per head measured")
    sparse_nodes: int = Field(32, gt=0, description="nodes of the stored sparse tree")
    engine_prompts: int = Field(4, ge=0, description="held-out prompts the engine decodes "
                                                       "at every report (0: none)")
    engine_tokens: int = Field(32, gt=0, description="greedy tokens per engine prompt")
    features: Literal["offline", "online"] = Field("offline", description=(
        "offline: the target's features and top-k stored beside each prompt + greedy "
        "continuation (medusa shards); online: only the tokens are stored (medusa_windows "
        "shards) and the frozen target computes its features and top-k inside each "
        "training step on the worker's device"))
    online_top_k: int = Field(8, gt=0, description=(
        "online: the target probabilities kept per position (MEDUSA-2's KL; offline: "
        "distill.top_k)"))

    @field_validator("variants")
    @classmethod
    def _known_objectives(cls, names: list[str]) -> list[str]:
        for name in names:
            objective(name, "medusa", "unknown objective")
        return names


#: ``compare.losses`` rows -> (the drafter's ``eagle.version``, its ``eagle.loss``)
EAGLE_COMPARE_ROWS = {"eagle": (1, "eagle"), "hass": (1, "hass"), "talf": (1, "talf"),
                      "eagle3": (3, "eagle3"), "eagle3_talf": (3, "talf")}


class EagleCompareConfig(StrictModel):
    """``compare_eagle``: the EAGLE-family drafters trained one after another on the same
    windows. Rows (:data:`EAGLE_COMPARE_ROWS`): ``eagle``, ``hass``, ``talf`` (EAGLE-1/2
    drafters) and ``eagle3``, ``eagle3_talf`` (EAGLE-3 drafters, trained with the
    ``eagle`` group updated by ``eagle3``, e.g. ``{draft_vocab: 512, ttt_steps: 7}``).
    ``finetune_steps`` 0: each row trains from scratch for ``train.steps``; > 0: a base
    drafter per version (loss ``eagle``, resp. ``eagle3``) trains for ``train.steps``, then
    every row continues from its version's base for ``finetune_steps`` (the SALF & TALF
    paper's protocol, equal budgets); ``bases`` names an already trained base instead
    (e.g. ``{eagle3: models:/speclab-eagle3-reference/1}``)."""

    losses: list[Literal["eagle", "hass", "talf", "eagle3", "eagle3_talf"]] = Field(
        default_factory=lambda: ["eagle", "hass", "talf"], min_length=1)
    finetune_steps: int = Field(0, ge=0)
    eagle3: dict = Field(default_factory=dict, description="eagle.* settings of the EAGLE-3 "
                         "rows (feature_layers, draft_vocab, ttt_steps, ttt_decay)")
    bases: dict[Literal["eagle", "eagle3"], str] = Field(
        default_factory=dict, description="with finetune_steps: a trained drafter (folder or "
        "models:/ URI) to use as that version's base instead of training one")

    def row_eagle(self, row: str, eagle: EagleTrainConfig, **update) -> EagleTrainConfig:
        """The validated ``eagle`` group of compare row ``row`` (its version and loss;
        EAGLE-3 rows with ``eagle3``'s settings), updated with ``update``."""
        version, loss = EAGLE_COMPARE_ROWS[row]
        data = {**eagle.model_dump(), "version": version, "loss": loss, **update}
        if version == 3:
            data.update(self.eagle3)
        try:
            return EagleTrainConfig.model_validate(data)
        except ValueError as exc:
            raise ValueError(f"compare.eagle3 (row {row!r}): {exc}") from None


class CompareConfig(StrictModel):
    """Losses trained one after another by ``compare_losses`` (same data, arch, budget)."""

    losses: list[str] = Field(
        default_factory=lambda: ["sft", "word_kd", "seq_kd", "tvd_kd", "hass_topk", "talf"])

    @model_validator(mode="after")
    def _known(self):
        from speclab.losses import registered_losses, unknown_losses

        unknown = unknown_losses(self.losses)
        if unknown or not self.losses:
            raise ValueError(f"losses must be non-empty names from "
                             f"{sorted(registered_losses())}; unknown: {unknown}")
        return self


class OrderingConfig(StrictModel):
    """One ordering an evaluation tests (``speclab.orderings``): the method labelled
    ``above`` accepts more than the one labelled ``below`` (``ar``: plain decoding), as a
    median paired tau ratio over the prompts with its interval; ``claim``: where the
    ordering comes from, for the table."""

    above: str
    below: str
    claim: str = ""


class RecConfig(StrictModel):
    """Recommendation data (AtSpeed): synthetic, or Amazon JSON lines / MovieLens
    ``ratings.dat`` at ``path``; semantic ids of ``levels`` codes from ``codebook``."""

    source: Literal["synthetic", "amazon", "movielens"] = "synthetic"
    path: str | None = None
    users: int = Field(500, gt=0)
    items: int = Field(400, gt=1)
    dim: int = Field(16, gt=0)
    levels: int = Field(4, gt=0)
    codebook: int = Field(32, gt=1)
    history: int = Field(10, gt=0, description="items of history in a prompt")
    seed: int = 0

    @model_validator(mode="after")
    def _path_for_files(self):
        if self.source != "synthetic" and not self.path:
            raise ValueError(f"path is required when source is {self.source!r}")
        return self


class RecEvalConfig(StrictModel):
    """``recommend_eval``: models (trained on the fly when not given), K, N, gamma.

    Drafters are trained for every ``losses`` entry not in ``drafts`` (AtSpeed losses
    once per ``align_alphas`` value, the AtSpeed alignment-loss weight)."""

    renamed = {"alphas": "align_alphas", "alpha": "align_alphas", "draft_loss": "losses"}

    target: str | None = Field(None, description="recommender folder / models:/ URI")
    drafts: dict[str, str] = Field(default_factory=dict, description="name -> drafter")
    draft_arch: ArchConfig = ArchConfig(layers=1, hidden=64, heads=4)
    draft_steps: int = Field(60, gt=0, description="steps of each on-the-fly drafter")
    losses: list[str] = Field(default_factory=lambda: ["sft"],
                              description="drafters trained for the losses not in drafts")
    align_alphas: list[float] = Field(
        default_factory=lambda: [0.5],
        description="AtSpeed loss weights alpha tried for atspeed_s/atspeed_r")
    align_k: int = Field(5, gt=0, description="target top-K beams per alignment example")
    align_examples: int = Field(512, gt=0, description="training examples with beams")
    mix_lambda: float = Field(
        0.5, ge=0.0, le=1.0,
        description="AtSpeed-S data: top-K beams of (1-lambda) drafter + lambda target; "
                    "the drafter is the sft drafter (1 = the target's beams)")
    align_tasks: int = Field(0, ge=0, description="Ray tasks generating alignment data "
                                                 "(0: one per CPU of the cluster)")
    ks: list[int] = Field(default_factory=lambda: [1, 3, 5, 10, 20])
    ns: list[int] = Field(default_factory=lambda: [40], description="draft beam sizes N")
    gamma: int = Field(3, gt=0)
    verify: list[Literal["strict", "relaxed"]] = Field(
        default_factory=lambda: ["strict", "relaxed"])
    test_users: int = Field(50, gt=0)

    @model_validator(mode="after")
    def _positive(self):
        known = sorted(objectives("atspeed", plugins=False))
        if any(n not in known for n in self._losses()):  # a plugin's objective?
            known = sorted(objectives("atspeed"))
        if not self.ks or min(self.ks) < 1 or not self.ns or min(self.ns) < 1:
            raise ValueError("ks and ns must be non-empty lists of positive integers")
        unknown = [n for n in self._losses() if n not in known]
        if unknown:
            raise ValueError(f"unknown recommendation loss {unknown}; known: {known}")
        if not self.align_alphas or not all(0.0 <= a <= 1.0 for a in self.align_alphas):
            raise ValueError("align_alphas must be a non-empty list of values in [0, 1]")
        return self

    def _losses(self) -> list[str]:
        return list(self.losses)


class RecTrialConfig(RecEvalConfig):
    """``rec_eval`` of an AtSpeed sweep (``tune`` with ``sweep.kind: atspeed``): every
    trial trains ONE drafter with ``draft_loss`` and AtSpeed weight ``align_alpha``
    (``losses`` / ``align_alphas`` only say which sft drafter a mixture needs)."""

    renamed = {"alphas": "align_alphas", "alpha": "align_alpha"}

    draft_loss: str = Field("atspeed_r", description="loss of every trial's drafter")
    align_alpha: float = Field(0.5, ge=0.0, le=1.0,
                               description="AtSpeed loss weight alpha of the trial's drafter")

    def _losses(self) -> list[str]:
        return [*self.losses, self.draft_loss]


class HeadConfig(StrictModel):
    """SpecDec++ acceptance head: architecture, training data mix and loss weights."""

    depth: int = Field(1, ge=0, le=8, description="residual SiLU blocks before the output "
                                                  "layer (0 = linear)")
    w_acc: float = Field(1.0, ge=0.0, description="BCE weight of the accept class")
    w_rej: float = Field(3.0, ge=0.0, description="BCE weight of the reject class")
    mix_ratio: float = Field(0.5, ge=0.0, lt=1.0,
                             description="r: share of response tokens taken from the target")
    temperature: float = Field(0.0, ge=0.0, description="decoding temperature the head is "
                                                        "trained for (0: greedy acceptance)")

    @model_validator(mode="after")
    def _some_weight(self):
        if self.w_acc + self.w_rej <= 0:
            raise ValueError("w_acc and w_rej: at least one must be positive")
        return self


class AdaptiveEvalConfig(StrictModel):
    """SpecDec++ comparison: fixed gamma vs heads x thresholds (jobs/specdecpp_eval.py)."""

    heads: dict[str, str] = Field(
        default_factory=dict,
        description="name -> head folder or models:/ URI; empty: train one per depth x w_rej")
    depths: list[int] = Field(default_factory=lambda: [1], description="heads trained (D)")
    w_rejs: list[float] = Field(default_factory=lambda: [3.0], description="heads trained")
    gammas: list[int] = Field(default_factory=lambda: list(range(2, 15)))
    thresholds: list[float] = Field(
        default_factory=lambda: [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
    max_draft: int = Field(20, gt=0)

    @model_validator(mode="after")
    def _ranges(self):
        if not self.gammas or min(self.gammas) < 1:
            raise ValueError("gammas: must be a non-empty list of positive integers")
        if not self.thresholds or not all(0.0 < h < 1.0 for h in self.thresholds):
            raise ValueError("thresholds: every threshold h must be in (0, 1)")
        if min(self.depths, default=0) < 0 or min(self.w_rejs, default=0.0) < 0:
            raise ValueError("depths and w_rejs: must not be negative")
        return self


class DatastoreConfig(StrictModel):
    """REST datastore built by jobs/build_datastore.py from the ``corpus`` group."""

    output: str | None = Field(None, description="folder (default <SPECLAB_HOME>/datastores/"
                                                 "<name>)")
    shards: int = Field(2, gt=0, description="corpus shards, one Ray task each")
    max_len: int = Field(16, gt=0, description="suffix-array sort depth = longest key")


class RetrievalEvalConfig(StrictModel):
    """jobs/retrieval_eval.py: context-reuse tasks (see speclab.data.tasks)."""

    tasks: list[Literal["code_completion", "docstring_qa", "docstring_summary"]] = Field(
        default_factory=lambda: ["code_completion", "docstring_qa", "docstring_summary"])
    num_prompts: int = Field(8, gt=0, description="examples per task")
    context_chars: int = Field(1500, gt=0, description="file prefix / function size limit")
    reference_chars: int = Field(200, gt=0, description="code completion reference length")
    hf_prompt_lookup: int = Field(10, ge=0, description="also time HF prompt lookup with "
                                                        "this many tokens (0: skip)")


class SweepParam(StrictModel):
    """One swept parameter: exactly one of grid / choice / uniform / loguniform / randint."""

    grid: list | None = None
    choice: list | None = None
    uniform: tuple[float, float] | None = None
    loguniform: tuple[float, float] | None = None
    randint: tuple[int, int] | None = Field(None, description="[low, high) integers")

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [k for k in ("grid", "choice", "uniform", "loguniform", "randint")
                 if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of grid/choice/uniform/loguniform/randint, "
                             f"got {given or 'none'}")
        kind = given[0]
        if kind in ("grid", "choice") and not getattr(self, kind):
            raise ValueError(f"{kind}: must not be empty")
        lo_hi = getattr(self, kind)
        if kind in ("uniform", "loguniform", "randint") and not lo_hi[0] < lo_hi[1]:
            raise ValueError(f"{kind}: low must be < high, got {list(lo_hi)}")
        if kind == "loguniform" and lo_hi[0] <= 0:
            raise ValueError("loguniform: low must be > 0")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in ("grid", "choice", "uniform", "loguniform", "randint")
                    if getattr(self, k) is not None)


class SweepConfig(StrictModel):
    """The ``tune`` job: a Ray Tune search over dotted paths of the tune config itself
    (the groups its ``kind`` uses: :func:`speclab.config.jobs.tune_groups`)."""

    kind: str = Field(
        "decode", description="decode: evaluate `method` with trained models; or a trained "
                              "family's trial kind (speclab.families): train_head: train an "
                              "acceptance head per trial, then evaluate specdecpp; atspeed: "
                              "train a rec drafter per trial, then beam SD; eagle: train an "
                              "EAGLE drafter per trial, then evaluate `method` (eagle) with it")

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, kind: str) -> str:
        if kind == "decode":
            return kind
        known = ["decode", *sorted(sweep_kinds(kind))]
        if kind not in known:
            raise ValueError(f"unknown sweep kind {kind!r}; known: {', '.join(known)}")
        return kind
    space: dict[str, SweepParam] = Field(default_factory=dict,
                                         description="dotted config path -> values")
    search: Literal["grid", "random", "optuna"] = "grid"
    scheduler: Literal["fifo", "asha"] = "fifo"
    num_samples: int = Field(1, gt=0, description="trials (grid: repeats of the grid)")
    max_concurrent: int = Field(1, gt=0)
    metric: str = Field("predicted_speedup", description="objective reported by every trial")
    mode: Literal["max", "min"] = "max"
    floor: dict[str, float] = Field(default_factory=dict,
                                    description="constraints: metric -> minimum value")
    task: Literal["code_completion", "docstring_qa", "docstring_summary"] | None = Field(
        None, description="decode trials on this task's prompts, with its accuracy metric")
    grace_period: int = Field(1, gt=0, description="ASHA: reports before a trial can stop")
    trial_cpus: float = Field(1.0, gt=0, description="CPUs per trial actor")
    trial_gpus: float | None = Field(
        None, ge=0, le=1,
        description="GPUs per trial actor (a fraction shares one GPU); default: 1 with a "
                    "CUDA models.device (cuda, or auto on a cluster with GPUs), else 0")

    @model_validator(mode="after")
    def _space(self):
        if not self.space:
            raise ValueError("space: at least one swept parameter is needed")
        kinds = {p.kind for p in self.space.values()}
        if self.search == "grid" and kinds - {"grid", "choice"}:
            raise ValueError("search grid: every parameter needs grid or choice values")
        if self.search == "optuna" and "grid" in kinds:
            raise ValueError("search optuna: use choice instead of grid")
        for path in self.space:
            if "." not in path:
                raise ValueError(f"space: {path!r} must be a dotted path like method.gamma")
        return self


class AutoscalingSettings(StrictModel):
    """Ray Serve autoscaling of one deployment (replaces its fixed ``replicas``)."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(2, gt=0)
    target_ongoing_requests: float = Field(
        2.0, gt=0.0, description="ongoing calls per replica the autoscaler aims at")
    upscale_delay_s: float = Field(30.0, ge=0.0)
    downscale_delay_s: float = Field(600.0, ge=0.0)

    @model_validator(mode="after")
    def _range(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas: must not exceed max_replicas")
        return self


class ReplicaConfig(StrictModel):
    """One Ray Serve deployment's replicas and the resources of each."""

    replicas: int = Field(1, gt=0)
    num_cpus: float = Field(0.5, gt=0.0, description="fractional CPUs per replica")
    num_gpus: float = Field(0.0, ge=0.0, description="1 puts each replica on its own GPU")
    max_ongoing_requests: int = Field(64, gt=0)
    torch_threads: int = Field(1, gt=0, description="torch CPU threads per replica")
    omp_wait_policy: Literal["active", "passive"] | None = Field(
        None, description="OpenMP threads of an idle replica spin (active) or sleep "
                          "(passive); None: the OpenMP default (spin a while)")
    autoscaling: AutoscalingSettings | None = Field(
        None, description="scale between min and max replicas on ongoing requests")

    @property
    def max_count(self) -> int:
        """The most replicas this deployment can have."""
        return self.autoscaling.max_replicas if self.autoscaling else self.replicas


class ServeConfig(StrictModel):
    """``speclab serve`` / ``serve_apps.app``: target and draft as separate deployments
    behind an HTTP ingress; the method is ``method``, the models ``models``."""

    host: str = Field("127.0.0.1", description="HTTP address (local only by default)")
    port: int = Field(8000, gt=0, lt=65536)
    app_name: str = "speclab"
    model_name: str | None = Field(None, description="name in /v1/models (default: name)")
    target: ReplicaConfig = ReplicaConfig()
    draft: ReplicaConfig = ReplicaConfig()
    ingress: ReplicaConfig = ReplicaConfig(num_cpus=0.25, max_ongoing_requests=64)
    max_tokens: int = Field(512, gt=0, description="largest max_tokens a request may ask")
    prefill_chunk: int | None = Field(
        None, gt=0, description="prompt tokens a target replica prefills per batch step "
                                "(chunked prefill: a long prompt never holds the other "
                                "requests' rounds for more; null: whole prompts)")
    max_model_len: int | None = Field(
        None, gt=0, description="prompt + max_tokens a request may ask, below the target's "
                                "own context length (default: the target's)")
    request_timeout_s: float | None = Field(
        None, gt=0.0, description="seconds a request may decode (a request's own timeout "
                                  "can only lower it); past it the reply holds the tokens "
                                  "decoded by then, its replicas' states are freed; null: "
                                  "no deadline")
    spec_decode_metrics: Literal["none", "summary", "detailed"] = Field(
        "summary", description="each OpenAI reply's SD statistics in vLLM's schema "
                               "(metrics.speculative_decoding, as vLLM's "
                               "--per-request-spec-decode-metrics): summary; detailed adds "
                               "the per-step arrays; none leaves the reply without them")
    max_sessions: int = Field(64, gt=0, description="live requests per replica (LRU evicted)")
    max_cached_tokens: int = Field(
        65536, gt=0, description="KV positions per replica over all its requests")
    idle_timeout_s: float = Field(60.0, gt=0.0, description="state of a silent request freed")
    max_batch: int = Field(64, gt=0, description="steps per batch: requests on a draft "
                                                   "replica, calls on a target replica")
    batch_wait_ms: float = Field(
        5.0, ge=0.0, description="longest wait for the other live requests to join a batch")
    budget: Literal["fixed", "auto"] = Field(
        "fixed", description="fixed: every round drafts the method's own length; auto: "
                             "each request's rounds choose their draft depth (0: plain "
                             "decoding) from the calibrated forward costs at the replica's "
                             "current batch and the request's running acceptance (outputs "
                             "unchanged; drafting ahead is off for such requests)")
    topology: Literal["split", "colocated"] = Field(
        "split", description="split: target and draft as separate deployments (separate "
                             "devices or processes; rounds cross a deployment hop); "
                             "colocated: both models in ONE deployment whose replicas run "
                             "each round in process (one device; serve.target's replicas "
                             "and resources, serve.draft's unused)")
    direct_rounds: bool = Field(
        True, description="draft -> target round calls over a Unix socket when both "
                          "replicas share a node (else Serve handle calls)")
    draft_ahead: bool = Field(
        True, description="draft a request's next round while the target verifies this "
                          "one (greedy requests, model drafters; outputs unchanged)")
    ahead_warmup: int = Field(8, gt=0, description="rounds drafted ahead before the hit "
                                                    "rate can switch it off for a request")
    ahead_min_hit_rate: float = Field(
        0.2, ge=0.0, le=1.0, description="drafting ahead stops for a request below this "
                                         "hit rate (or whose hits saved less than it cost)")
    api_key: str | None = Field(None, description="required as 'Authorization: Bearer <key>'")
    access_log: bool = Field(
        False, description="Serve's per-call access log lines (each costs CPU in the "
                            "replica and in the driver that prints it)")
    metrics_port: int | None = Field(
        None, gt=0, lt=65536, description="Prometheus port of the embedded Ray (/metrics)")
    rec_target: str | None = Field(None, description="recommender for POST /recommend")
    rec_draft: str | None = Field(None, description="its drafter (beam SD)")
    rec_n: int = Field(10, gt=0, description="/recommend default draft beam size N")
    rec_gamma: int = Field(3, gt=0, description="/recommend draft steps per round")

    @model_validator(mode="after")
    def _rec_pair(self):
        if (self.rec_target is None) != (self.rec_draft is None):
            raise ValueError("rec_target and rec_draft: give both (or neither)")
        if self.api_key == "":
            raise ValueError("api_key: must not be empty (leave it out to turn keys off)")
        if self.host not in ("127.0.0.1", "localhost", "::1") and not self.api_key:
            raise ValueError(f"api_key: required when serving on {self.host!r} (not only "
                             f"this machine); set serve.api_key or --api-key")
        return self

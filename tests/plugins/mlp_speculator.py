"""A whole trained drafter family from a plugin: the MLP speculator (method ``mlp_speculator``).

Named in ``$SPECLAB_PLUGINS`` (and ``$SPECLAB_METHODS`` for the CLI's ``--method``
choices), this module adds, with no edit to the ``speclab`` package: the decoding method
and its drafter, the model with its folder format, two objectives, the Ray Train task, the
training group, the artifact check and the family declaration with its Tune trial kind.
``jobs.train_drafter`` trains it (``family: mlp_speculator``), ``speclab generate
--method mlp_speculator --mlp-model DIR`` decodes with it, Serve serves it and ``tune``
sweeps it (``sweep.kind: mlp_speculator``).

The model, after IBM's / Snowflake Arctic's "MLP speculator": from the target's last
hidden state ``h_t`` (the LM head's input, whose argmax is the round's root token
``x_{t+1}``) and that token, ``depth`` small stages each predict one more token::

    s_0 = h_t;  s_k = GELU(LN_k(a * P_k s_{k-1} + b * E_k x_{t+k})),  p_k = softmax(W_k s_k)

Stage ``k`` predicts ``x_{t+k+1}``; ``a = 0.5 ** (0.5 / depth)`` and
``b = sqrt((1 - a^2) * inner / 2)`` keep the state's scale from stage to stage (IBM's
weighting). Decision: each stage has its OWN embedding ``E_k`` and head ``W_k`` (as in
IBM's speculator; the target's LM head is not shared), so an artifact is self-contained
and never needs the target's weights to load. Drafting runs the stages greedily: a chain
of deterministic proposals, so decoding stays lossless (greedy and sampled).

Training data is the built-in ``feat`` kind (corpus windows, the target's last-layer
features and top-k); ``mlp_ce`` trains stage ``k`` on the corpus token ``x_{t+k+1}``
(teacher forcing), ``mlp_kd`` on the target's own top-k after ``x_{t+k}``; stage ``k``
weighs ``stage_decay ** (k - 1)``.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F
from pydantic import Field, field_validator
from torch import nn

from speclab.config.base import StrictModel
from speclab.config.method import MethodSpec, register
from speclab.config.schema import ArchConfig
from speclab.decoding.drafter import Drafter
from speclab.decoding.tree import DETERMINISTIC, TokenTree
from speclab.families.objectives import Objective, objective, register_objective
from speclab.families.registry import register_family
from speclab.families.spec import SweepSpec, TrainedFamily
from speclab.models.loading import registry_or_folder
from speclab.train.tasks import TaskBase, TaskConfigBase, register_task, step_generator

FAMILY_NAME = "mlp_speculator"
KIND = "speclab-mlp-speculator"  # config.json's "kind": what marks an artifact folder
FIELD = "mlp_model"  # the method's field a trained artifact fills
_M = __name__  # "tests.plugins.mlp_speculator": where the declaration's references point
_G = "speclab.pipelines.family_train"  # the generic Tune hooks of a ``drafter`` group


# --- the model -----------------------------------------------------------------------

@dataclass(frozen=True)
class MlpMeta:
    """What an MLP speculator is and the target it was trained for (``config.json``)."""

    target: str
    target_architecture: str
    vocab_size: int
    hidden_size: int
    inner: int
    depth: int
    kind: str = KIND

    @classmethod
    def for_target(cls, config: Any, name: str, inner: int, depth: int) -> MlpMeta:
        """The meta of a ``depth``-stage speculator of width ``inner`` (0: the target's
        hidden size) for the target whose HF ``config`` is given."""
        arch = (getattr(config, "architectures", None) or [type(config).__name__])[0]
        hidden = int(config.hidden_size)
        return cls(str(name), arch, int(config.vocab_size), hidden, inner or hidden, depth)


class MlpSpeculator(nn.Module):
    """``depth`` MLP stages over the target's last feature (see the module docstring)."""

    def __init__(self, meta: MlpMeta) -> None:
        super().__init__()
        self.meta = meta
        h, i, v, d = meta.hidden_size, meta.inner, meta.vocab_size, meta.depth
        self.proj = nn.ModuleList(nn.Linear(h if k == 0 else i, i, bias=False) for k in range(d))
        self.emb = nn.ModuleList(nn.Embedding(v, i) for _ in range(d))
        self.ln = nn.ModuleList(nn.LayerNorm(i) for _ in range(d))
        self.head = nn.ModuleList(nn.Linear(i, v, bias=False) for _ in range(d))
        self.state_weight = 0.5 ** (0.5 / d)
        self.emb_weight = math.sqrt((1 - self.state_weight ** 2) * (i / 2))
        for m in self.modules():  # IBM's initialisation: N(0, 1/inner)
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, 0.0, 1 / math.sqrt(i))

    def stage(self, k: int, state: torch.Tensor, tokens: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage ``k`` (0-based): ``state [..., H or inner]`` and the previous tokens
        ``[...]`` -> (the next state ``[..., inner]``, logits ``[..., V]``)."""
        z = self.emb[k](tokens) * self.emb_weight
        state = F.gelu(self.ln[k](self.proj[k](state) * self.state_weight + z))
        return state, self.head[k](state)

    def forward(self, features: torch.Tensor, tokens: torch.Tensor) -> list[torch.Tensor]:
        """Teacher-forced training pass: ``features [B, L, H]`` (the target's, at inputs
        ``tokens[:, :L]``) and ``tokens [B, L+1]`` -> per stage ``k = 1..depth`` the logits
        ``[B, L-k, V]`` of ``x_{t+k+1}`` at positions ``t = 0..L-k-1``."""
        length = features.shape[1]
        state = features[:, : length - 1].to(self.proj[0].weight.dtype)
        out = []
        for k in range(self.meta.depth):
            n = length - 1 - k
            state, logits = self.stage(k, state[:, :n], tokens[:, k + 1: k + 1 + n])
            out.append(logits)
        return out

    @torch.no_grad()
    def draft(self, hidden: torch.Tensor, token: int, depth: int) -> tuple[list[int], list[float]]:
        """Greedy chain of ``depth`` tokens after ``token`` from the target's feature
        ``hidden [H]`` that produced it: (tokens, their draft probabilities), read with
        one host fetch."""
        w = self.proj[0].weight
        state = hidden.to(w.device, w.dtype)[None]  # [1, H]
        tok = torch.tensor([int(token)], device=w.device)
        ids, probs = [], []
        for k in range(min(depth, self.meta.depth)):
            state, logits = self.stage(k, state, tok)
            p, tok = logits.float().softmax(-1).max(-1)  # [1], [1]
            ids.append(tok)
            probs.append(p)
        if not ids:
            return [], []
        return torch.cat(ids).tolist(), torch.cat(probs).tolist()


def save_mlp(model: MlpSpeculator, folder: str | Path) -> Path:
    """``config.json`` (the :class:`MlpMeta`) and ``model.safetensors`` in ``folder``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(asdict(model.meta), indent=2))
    save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()},
              str(folder / "model.safetensors"))
    return folder


def load_mlp(folder: str | Path, dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu", field: str = FIELD) -> MlpSpeculator:
    """The speculator :func:`save_mlp` wrote to ``folder``; ValueError naming ``field``
    when the folder holds none."""
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        data = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        data = {}
    if data.get("kind") != KIND:
        raise ValueError(f"{field}: {str(folder)!r} holds no MLP speculator (a folder "
                         f"written by jobs.train_drafter with family {FAMILY_NAME})")
    meta = MlpMeta(**{k: v for k, v in data.items() if k in MlpMeta.__dataclass_fields__})
    model = MlpSpeculator(meta)
    model.load_state_dict(load_file(str(folder / "model.safetensors")))
    return model.to(device=device, dtype=dtype).eval()


def is_mlp_speculator(model: Any) -> bool:
    """Whether a loaded model is this family's artifact (the family's ``is_artifact``)."""
    return isinstance(model, MlpSpeculator)


def check_artifact(model: MlpSpeculator, target_config: Any, field: str = FIELD,
                   target_source: str | None = None, target_vocab: int | None = None) -> None:
    """The family's artifact check (offline builds, Serve's draft replica at load): a
    ValueError naming ``field`` when ``model`` was trained for a target of another
    vocabulary or hidden size than the one whose HF config is ``target_config``; without
    the config (None), the vocabulary ``target_vocab`` alone."""
    del target_source  # the sizes are the whole check: no fingerprint
    have = {"vocab_size": target_vocab} if target_config is None else {
        name: getattr(target_config, name) for name in ("vocab_size", "hidden_size")}
    for name, value in have.items():
        want = int(getattr(model.meta, name))
        if value is not None and int(value) != want:
            raise ValueError(f"{field}: an MLP speculator trained for a target with {name}="
                             f"{want}, but the target has {int(value)}")


# --- the method ----------------------------------------------------------------------

class MlpSpeculatorDrafter(Drafter):
    """One sequence's drafter: a greedy chain from the target's last feature."""

    name = FAMILY_NAME

    def __init__(self, model: MlpSpeculator, depth: int) -> None:
        self.model = model
        self.depth = depth or model.meta.depth
        self.last: torch.Tensor | None = None
        self._calls, self._seconds = 0, 0.0

    @property
    def calls(self) -> int:
        return self._calls

    @property
    def seconds(self) -> float:
        return self._seconds

    def reset(self) -> None:
        self.last = None

    def observe(self, features: torch.Tensor) -> None:
        """Keep the last row of the target's features ``[n, H]`` (the stages' input)."""
        hidden = self.model.meta.hidden_size
        if features.ndim != 2 or features.shape[-1] != hidden:
            raise ValueError(f"{FIELD}: the speculator expects target features of width "
                             f"{hidden}, got shape {tuple(features.shape)}")
        if features.shape[0]:
            self.last = features[-1]

    def accept(self, tree: TokenTree, path: list[int]) -> None:
        """Nothing to prune: the stages keep no cache."""

    def propose(self, committed: list[int], budget: int) -> TokenTree:
        tree = TokenTree(committed[-1])
        if self.last is None or budget <= 0:  # a 1-token prompt: the target goes first
            return tree
        t0 = time.perf_counter()
        ids, probs = self.model.draft(self.last, committed[-1], min(self.depth, budget))
        self._calls += 1
        self._seconds += time.perf_counter() - t0
        node = 0
        for token, p in zip(ids, probs, strict=True):
            tree.set_children_kind(node, DETERMINISTIC)
            node = tree.add(token, node, p)
        return tree


@register
class MlpSpeculatorConfig(MethodSpec):
    """``mlp_speculator``: an MLP speculator (``mlp_model``) drafting a chain of
    ``depth`` tokens from the target's last feature."""

    name: Literal["mlp_speculator"] = "mlp_speculator"
    needs_draft_model = False  # the speculator is its own folder, not models.draft
    needs_features = True  # it reads the target's last-layer features
    mlp_model: Any = Field(None, validate_default=True, description=(
        "MLP speculator: a folder written by jobs.train_drafter (family mlp_speculator) "
        "or a models:/ URI"))
    depth: int = Field(0, ge=0, description="levels (stages) used; 0: every stage")

    @field_validator("mlp_model")
    @classmethod
    def _given(cls, v: Any) -> Any:
        if v is None or v == "":
            raise ValueError("method 'mlp_speculator' needs a speculator (--mlp-model DIR "
                             "or models:/ URI)")
        if isinstance(v, os.PathLike):
            return os.fspath(v)
        if not isinstance(v, str | MlpSpeculator):
            raise ValueError(f"must be a folder or models:/ URI, got {type(v).__name__}")
        return v

    def build(self, ctx: Any) -> MlpSpeculatorDrafter:
        """Load the speculator once per Decoder / Serve replica (``ctx.cached``) in the
        target's dtype and device, checked against the target when it is at hand."""
        model = self.mlp_model
        if not isinstance(model, MlpSpeculator):
            source = str(model)
            model = ctx.cached((FAMILY_NAME, source), lambda: load_mlp(
                registry_or_folder(source, FIELD), ctx.dtype, ctx.device))
        if ctx.target_config is not None:
            check_artifact(model, ctx.target_config)
        return MlpSpeculatorDrafter(model, self.depth)


# --- training: the group, the objectives, the task --------------------------------------

class MlpTrainConfig(StrictModel):
    """The ``drafter`` group of ``jobs.train_drafter`` / a ``tune`` sweep of this family."""

    loss: str = Field("mlp_ce", description="objective: mlp_ce (corpus tokens) or mlp_kd "
                                            "(the target's top-k)")
    depth: int = Field(3, ge=1, le=16, description="stages: tokens drafted per round")
    hidden: int = Field(0, ge=0, description="width of each stage's state; 0: the "
                                             "target's hidden size")
    stage_decay: float = Field(1.0, gt=0.0, le=1.0, description="stage k's loss weight is "
                                                                  "stage_decay ** (k - 1)")

    @field_validator("loss")
    @classmethod
    def _known_objective(cls, name: str) -> str:
        objective(name, FAMILY_NAME, "unknown objective")  # ValueError listing the known
        return name


class StageKnobs(StrictModel):
    """The knobs of both objectives: the per-stage weight decay."""

    stage_decay: float = Field(1.0, gt=0.0, le=1.0)


def _weighted(terms: list[torch.Tensor], decay: float) -> torch.Tensor:
    """``sum_k decay**(k-1) * terms[k-1] / sum_k decay**(k-1)``."""
    weights = [decay ** k for k in range(len(terms))]
    return sum(w * t for w, t in zip(weights, terms, strict=True)) / sum(weights)


def ce_objective(model: nn.Module, batch: dict, knobs: StageKnobs) -> torch.Tensor:
    """``mlp_ce``: stage ``k``'s cross-entropy on the corpus token ``x_{t+k+1}``
    (``tokens [B, L+1]``, ``features [B, L, H]``)."""
    logits = model(batch["features"], batch["tokens"])
    terms = [F.cross_entropy(lg.flatten(0, 1).float(), batch["tokens"][:, k + 1:].flatten())
             for k, lg in enumerate(logits, start=1)]
    return _weighted(terms, knobs.stage_decay)


def kd_objective(model: nn.Module, batch: dict, knobs: StageKnobs) -> torch.Tensor:
    """``mlp_kd``: stage ``k``'s cross-entropy against the target's renormalised top-k
    after ``x_{t+k}`` (``topk_ids/probs [B, L, K]``, positions ``k..L-1``)."""
    terms = []
    for k, lg in enumerate(model(batch["features"], batch["tokens"]), start=1):
        ids, p = batch["topk_ids"][:, k:], batch["topk_probs"][:, k:]  # [B, L-k, K]
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
        terms.append(-(p * lg.float().log_softmax(-1).gather(-1, ids)).sum(-1).mean())
    return _weighted(terms, knobs.stage_decay)


def depth_within_window(group: MlpTrainConfig, job: Any) -> None:
    """Every stage needs a label inside a training window."""
    if group.depth >= job.distill.seq_len:
        raise ValueError(f"drafter.depth ({group.depth}) must be below distill.seq_len "
                         f"({job.distill.seq_len}): stage k predicts k + 1 tokens ahead")


for _name, _fn, _doc in (("mlp_ce", "ce_objective", "MLP speculator: CE on corpus tokens"),
                         ("mlp_kd", "kd_objective", "MLP speculator: the target's top-k")):
    register_objective(Objective(name=_name, family=FAMILY_NAME, loss=f"{_M}:{_fn}",
                                 data_kind="feat", knobs=f"{_M}:StageKnobs",
                                 validate=f"{_M}:depth_within_window", doc=_doc))


def collate_feat(rows: list[dict]) -> dict[str, torch.Tensor]:
    """``feat`` rows -> ``tokens [B, L+1]``, ``features [B, L, H]`` (float32),
    ``topk_ids [B, L, K]`` (long), ``topk_probs [B, L, K]``."""
    hidden = int(rows[0]["hidden"])
    feats = [np.frombuffer(r["features"], dtype=np.float16).reshape(-1, hidden) for r in rows]
    return {"tokens": torch.tensor([r["tokens"] for r in rows], dtype=torch.long),
            "features": torch.from_numpy(np.stack(feats).astype(np.float32)),
            "topk_ids": torch.tensor([r["topk_ids"] for r in rows], dtype=torch.long),
            "topk_probs": torch.tensor([r["topk_probs"] for r in rows], dtype=torch.float)}


class MlpTaskConfig(TaskConfigBase):
    """An MLP speculator for the target in local folder ``target``."""

    kind: Literal["mlp_speculator"] = "mlp_speculator"
    arch: ArchConfig | None = None
    drafter: MlpTrainConfig = MlpTrainConfig()
    target: str


class MlpTask(TaskBase):
    """The speculator on ``feat`` shards (the last one held out), its objective looked up
    in the objective registry."""

    def __init__(self, cfg: MlpTaskConfig, data_dir: Path, device: torch.device) -> None:
        self.tr, self.group, self.target, self.device = cfg.train, cfg.drafter, cfg.target, device
        self.objective = objective(self.group.loss, FAMILY_NAME, "drafter.loss")
        kind = self.objective.kind_for(self.group)
        shards = sorted((Path(data_dir) / kind).glob("shard-*.parquet"))
        if len(shards) < 2:
            raise ValueError(f"{FAMILY_NAME}: need >= 2 {kind} shards (one is held out), "
                             f"found {len(shards)} in {Path(data_dir) / kind}")
        self.val = pq.read_table(shards[-1]).to_pylist()
        self.rows = [r for s in shards[:-1] for r in pq.read_table(s).to_pylist()]

    def build_model(self) -> MlpSpeculator:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.target, trust_remote_code=False)
        return MlpSpeculator(MlpMeta.for_target(config, self.target, self.group.hidden,
                                                self.group.depth)).float()

    def _on_device(self, rows: list[dict]) -> dict:
        return {k: v.to(self.device) for k, v in collate_feat(rows).items()}

    def batch(self, step: int, rank: int) -> dict:
        g = step_generator(self.tr.seed, step, rank)
        idx = torch.randint(0, len(self.rows), (self.tr.batch_size,), generator=g).tolist()
        return self._on_device([self.rows[i] for i in idx])

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        return self.objective.compute(model, batch, self.group)

    def tokens_in(self, batch: dict) -> int:
        return int(batch["tokens"].numel())

    @torch.no_grad()
    def validate(self, model: nn.Module) -> float:
        """The training loss on held-out windows."""
        model.eval()
        out = float(self.loss(model, self._on_device(self.val[: self.tr.batch_size * 4])))
        model.train()
        return out

    @torch.no_grad()
    def val_metrics(self, model: nn.Module) -> dict[str, float]:
        """``val_top1_s<k>``: how often stage ``k``'s argmax is the target's greedy token
        (teacher-forced, held-out windows); ``val_top1``: stage 1's."""
        model.eval()
        batch = self._on_device(self.val[: self.tr.batch_size * 4])
        out = {}
        for k, lg in enumerate(model(batch["features"], batch["tokens"]), start=1):
            want = batch["topk_ids"][:, k:, 0]  # the target's argmax after x_{t+k}
            out[f"val_top1_s{k}"] = float((lg.argmax(-1) == want).float().mean())
        out["val_top1"] = out["val_top1_s1"]
        model.train()
        return out


register_task(MlpTaskConfig, MlpTask)


# --- the family's hooks ----------------------------------------------------------------

def data_kinds(group: MlpTrainConfig) -> set[str]:
    """The data kinds the ``drafter`` group trains on: its objective's (``feat``)."""
    return {objective(group.loss, FAMILY_NAME, "drafter.loss").kind_for(group)}


def save_final(result: Any, target: str, run_dir: str | Path) -> Path:
    """The last checkpoint's speculator (its meta is stored with it) written with
    :func:`save_mlp` to ``run_dir/mlp_speculator``."""
    del target  # the checkpoint's meta names it
    with result.checkpoint.as_directory() as d:
        state = torch.load(Path(d) / "state.pt", weights_only=False, map_location="cpu")
    model = MlpSpeculator(MlpMeta(**state["meta"]))
    model.load_state_dict(state["model"])
    return save_mlp(model, Path(run_dir) / FAMILY_NAME)


def draft_time(dec: Any, cfg: Any, prompt: list[int]) -> float:
    """Median seconds of one drafting call (every stage) after ``prompt``: the cost
    model's ``t_draft`` (weights do not change it: ``method.mlp_model`` when it is a
    folder outside a sweep of this family, else an untrained speculator of the
    ``drafter`` group's shape)."""
    source = getattr(cfg.method, FIELD, None)
    sweeping = cfg.sweep is not None and cfg.sweep.kind == FAMILY_NAME
    config = dec.target.model.config
    if not sweeping and isinstance(source, str) and Path(source, "config.json").exists():
        model = load_mlp(source)
    else:
        group = MlpTrainConfig.model_validate(getattr(cfg, "drafter", None) or {})
        model = MlpSpeculator(MlpMeta.for_target(config, "", group.hidden, group.depth))
    model = model.to(dec.target.device, dec.target.dtype).eval()
    hidden = torch.zeros(int(config.hidden_size))
    times = []
    for _ in range(16):
        t0 = time.perf_counter()
        model.draft(hidden, prompt[-1], model.meta.depth)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


FAMILY = register_family(TrainedFamily(
    name=FAMILY_NAME,
    summary="MLP speculator (IBM / Arctic): depth MLP stages on the target's last feature",
    task=FAMILY_NAME,
    task_module=_M,
    train_group="drafter",
    train_config=f"{_M}:MlpTrainConfig",
    objectives=("mlp_ce", "mlp_kd"),
    method=FAMILY_NAME,
    artifact_field=FIELD,
    data_kinds=f"{_M}:data_kinds",
    save=f"{_M}:save_final",
    is_artifact=f"{_M}:is_mlp_speculator",
    check_artifact=f"{_M}:check_artifact",
    formats_in=("speclab",),
    formats_out=("speclab",),
    job="train_drafter",
    draft_time=f"{_M}:draft_time",
    sweep=SweepSpec(
        kind=FAMILY_NAME,
        groups=("drafter", "models", "data", "decoding", "method", "retrieval", "corpus",
                "tokenizer", "distill", "train", "scaling", "output"),
        heldout_metric="val_loss",
        trial="speclab.pipelines.tune_trials:family_trial",
        prepare=f"{_G}:prepare_sweep",
        generate=f"{_G}:generate_sweep",
        validate=f"{_G}:validate_sweep",
    ),
))

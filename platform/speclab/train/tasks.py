"""Training tasks handed to the Ray Train loop: what a step's batch is and its loss.

Each task has a small typed config (:class:`LMTaskConfig`, :class:`DistillTaskConfig`,
... selected by ``kind``) holding only what it needs: the ``train`` group, the model's
``arch`` and the task's own knobs. Jobs build it on the driver and workers get its JSON
dump (re-validated there by :func:`parse_task_config`), never the whole experiment.
A task is built on each worker from its config and a data folder:
``batch(step, rank)`` is deterministic in (seed, step, rank), so a run resumed from a
checkpoint sees the same data; ``loss(model, batch)``; ``validate(model)`` on held-out data.

* :class:`LMTask` — next-token cross-entropy on random windows of a token stream
  (target training);
* :class:`DistillTask` — a drafter loss (or a weighted mix) on shards written by the
  distillation job's generation stage; the last shard of each kind is held out;
* :class:`RecTask` — L_Rec on "history -> next item id" examples (AtSpeed);
* :class:`RecAlignTask` — an AtSpeed drafter loss on the target's alignment data;
* :class:`HeadTask` — a SpecDec++ acceptance head on a frozen drafter;
* :class:`EagleTask` — an EAGLE feature drafter (EAGLE or HASS loss) on ``feat`` shards;
* :class:`MedusaTask` — Medusa heads (MEDUSA-1) or heads plus backbone (MEDUSA-2) on
  ``medusa`` shards.

A task may define ``build_model()``; otherwise the loop builds a LLaMA from ``arch``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import pyarrow.parquet as pq
import torch
from pydantic import Field, TypeAdapter

from speclab.config.base import StrictModel
from speclab.config.schema import (
    ArchConfig,
    EagleTrainConfig,
    HeadConfig,
    MedusaTrainConfig,
    TrainConfig,
)
from speclab.losses import loss_entry
from speclab.train.lm import eval_loss, lm_loss, random_windows


class _TaskConfig(StrictModel):
    """What every task has: the optimisation settings and the model's architecture
    (None when the task builds its own model, e.g. the acceptance head)."""

    train: TrainConfig = TrainConfig()
    arch: ArchConfig | None = ArchConfig()


class LMTaskConfig(_TaskConfig):
    kind: Literal["lm"] = "lm"


class DistillTaskConfig(_TaskConfig):
    """``weights``: loss name -> weight (``distill.loss_weights()``)."""

    kind: Literal["distill"] = "distill"
    weights: dict[str, float] = Field(default_factory=lambda: {"word_kd": 1.0})
    hass_k: int | None = None


class RecTaskConfig(_TaskConfig):
    kind: Literal["rec"] = "rec"


class RecAlignTaskConfig(_TaskConfig):
    """One AtSpeed-style drafter: its ``loss`` and AtSpeed weight ``align_alpha``."""

    kind: Literal["rec_align"] = "rec_align"
    loss: str = "sft"
    align_alpha: float = Field(0.5, ge=0.0, le=1.0)
    align_k: int = Field(5, gt=0)


class HeadTaskConfig(_TaskConfig):
    """An acceptance head on the frozen drafter in local folder ``draft``."""

    kind: Literal["head"] = "head"
    arch: ArchConfig | None = None
    head: HeadConfig = HeadConfig()
    draft: str


class EagleTaskConfig(_TaskConfig):
    """An EAGLE drafter for the target in local folder ``target`` (its embedding and LM
    head are copied and frozen)."""

    kind: Literal["eagle"] = "eagle"
    arch: ArchConfig | None = None
    eagle: EagleTrainConfig = EagleTrainConfig()
    target: str


class MedusaTaskConfig(_TaskConfig):
    """Medusa heads for the target in local folder ``target``: ``variant`` ``medusa1``
    (frozen backbone) or ``medusa2`` (joint fine-tuning). ``prompt_len``: the corpus
    prompt's tokens at the start of every row (``distill.prompt_len``): labels there are
    not the target's own, so calibration (and, unless ``medusa.prompt_labels``, the heads'
    loss) skips them."""

    kind: Literal["medusa"] = "medusa"
    arch: ArchConfig | None = None
    medusa: MedusaTrainConfig = MedusaTrainConfig()
    variant: Literal["medusa1", "medusa2"] = "medusa1"
    target: str
    prompt_len: int = Field(0, ge=0)


TaskConfig = Annotated[LMTaskConfig | DistillTaskConfig | RecTaskConfig | RecAlignTaskConfig
                       | HeadTaskConfig | EagleTaskConfig | MedusaTaskConfig,
                       Field(discriminator="kind")]
_TASK_ADAPTER: TypeAdapter = TypeAdapter(TaskConfig)


def parse_task_config(data: dict):
    """A task config from its JSON dump (what a Ray Train worker receives)."""
    return _TASK_ADAPTER.validate_python(data)


def _gen(seed: int, step: int, rank: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)


class LMTask:
    """Causal-LM training on ``data_dir/train.pt`` with validation on ``val.pt``."""

    def __init__(self, cfg: LMTaskConfig, data_dir: Path, device: torch.device) -> None:
        self.tr = cfg.train
        self.device = device
        self.tokens = torch.load(Path(data_dir) / "train.pt")
        self.val = torch.load(Path(data_dir) / "val.pt")

    def batch(self, step: int, rank: int) -> torch.Tensor:
        """``[B, seq_len + 1]`` windows."""
        g = _gen(self.tr.seed, step, rank)
        return random_windows(self.tokens, self.tr.batch_size, self.tr.seq_len, g).to(self.device)

    def loss(self, model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return lm_loss(model, batch)

    def tokens_in(self, batch: torch.Tensor) -> int:
        return batch.numel()

    def validate(self, model: torch.nn.Module) -> float:
        return eval_loss(model, self.val.to(self.device), self.tr.seq_len, self.tr.val_windows)


class DistillTask:
    """A drafter loss (``weights``: ``{name: weight}``) on generated shards. Each loss is
    looked up in the loss registry (:class:`speclab.losses.Loss`): the shards of its data
    kind, its collate and how it is applied; a step draws rows once per data kind and
    collates them once per (kind, collate)."""

    def __init__(self, cfg: DistillTaskConfig, data_dir: Path, device: torch.device) -> None:
        self.tr = cfg.train
        self.device = device
        self.knobs = {"hass_k": cfg.hass_k}
        self.weights = {k: float(w) for k, w in cfg.weights.items() if w > 0}
        self.entries = {name: loss_entry(name) for name in self.weights}
        self.train_rows: dict[str, list[dict]] = {}
        self.val_rows: dict[str, list[dict]] = {}
        for kind in {e.data for e in self.entries.values()}:
            shards = sorted((Path(data_dir) / kind).glob("shard-*.parquet"))
            if len(shards) < 2:
                raise ValueError(f"distill: need >= 2 {kind} shards (one is held out), "
                                 f"found {len(shards)} in {data_dir / kind}")
            self.val_rows[kind] = pq.read_table(shards[-1]).to_pylist()
            self.train_rows[kind] = [r for s in shards[:-1] for r in pq.read_table(s).to_pylist()]

    def _collated(self, rows_of: dict[str, list[dict]]) -> dict[tuple, dict]:
        """``{(kind, collate): batch}`` for every loss in use, each batch on the device."""
        out: dict[tuple, dict] = {}
        for e in self.entries.values():
            key = (e.data, e.collate)
            if key not in out:
                out[key] = {k: v.to(self.device) for k, v in e.collate(rows_of[e.data]).items()}
        return out

    def batch(self, step: int, rank: int) -> dict[tuple, dict]:
        """One collated batch per (data kind, collate) in use."""
        g = _gen(self.tr.seed, step, rank)
        rows_of = {}
        for kind, rows in self.train_rows.items():
            idx = torch.randint(0, len(rows), (self.tr.batch_size,), generator=g).tolist()
            rows_of[kind] = [rows[i] for i in idx]
        return self._collated(rows_of)

    def loss(self, model: torch.nn.Module, batch: dict[tuple, dict]) -> torch.Tensor:
        return sum(w * e.apply(model, batch[(e.data, e.collate)], e.fn, self.knobs)
                   for e, w in ((self.entries[n], w) for n, w in self.weights.items()))

    def tokens_in(self, batch: dict[tuple, dict]) -> int:
        return sum(int(b["inputs"].numel()) for b in batch.values())

    @torch.no_grad()
    def validate(self, model: torch.nn.Module) -> float:
        model.eval()
        val = self._collated({k: rows[: self.tr.batch_size * 4]
                              for k, rows in self.val_rows.items()})
        out = float(self.loss(model, val))
        model.train()
        return out


class RecTask:
    """L_Rec (AtSpeed eq. 37): cross-entropy on the next item's id tokens given the
    history prompt; examples and ``rec_meta.json`` come from ``data_dir``."""

    def __init__(self, cfg: RecTaskConfig | RecAlignTaskConfig, data_dir: Path,
                 device: torch.device) -> None:
        import json

        from speclab.data.rec_dataset import RecExample, RecMeta

        self.tr = cfg.train
        self.device = device
        self.meta = RecMeta.load(data_dir)
        rows = json.loads((Path(data_dir) / "examples.json").read_text())
        self.train = [RecExample(**r) for r in rows["train"]]
        self.val = [RecExample(**r) for r in rows["validation"]] or self.train[:64]

    def _collate(self, examples) -> dict:
        from speclab.data.rec_dataset import collate_rec

        return {k: v.to(self.device) for k, v in collate_rec(examples, self.meta).items()}

    def batch(self, step: int, rank: int) -> dict:
        g = _gen(self.tr.seed, step, rank)
        idx = torch.randint(0, len(self.train), (self.tr.batch_size,), generator=g).tolist()
        return self._collate([self.train[i] for i in idx])

    def loss(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        from speclab.losses import cross_entropy

        logits = model(input_ids=batch["inputs"]).logits
        return cross_entropy(logits, batch["labels"], batch["mask"])

    def tokens_in(self, batch: dict) -> int:
        return int(batch["inputs"].numel())

    @torch.no_grad()
    def validate(self, model: torch.nn.Module) -> float:
        model.eval()
        out = float(self.loss(model, self._collate(self.val[: self.tr.batch_size * 4])))
        model.train()
        return out


class RecAlignTask(RecTask):
    """A recommendation drafter trained with ``loss`` (sft, seq_kd, word_kd, tvd_kd,
    atspeed_s, atspeed_r) on the target's alignment data (``align.pt``: one row per
    training example, see :mod:`speclab.train.rec_align`)."""

    def __init__(self, cfg: RecAlignTaskConfig, data_dir: Path, device: torch.device) -> None:
        super().__init__(cfg, data_dir, device)
        self.rows = torch.load(Path(data_dir) / "align.pt", weights_only=False)
        self.train = self.train[: len(self.rows)]
        self.loss_name = cfg.loss
        self.alpha = cfg.align_alpha
        self.k = cfg.align_k

    def _collate_idx(self, idx: list[int]) -> dict:
        from speclab.train.rec_align import collate_align

        batch = collate_align([self.rows[i] for i in idx], [self.train[i] for i in idx],
                              self.meta, self.loss_name)
        return {part: {k: v.to(self.device) for k, v in b.items()}
                for part, b in batch.items()}

    def batch(self, step: int, rank: int) -> dict:
        g = _gen(self.tr.seed, step, rank)
        idx = torch.randint(0, len(self.rows), (self.tr.batch_size,), generator=g).tolist()
        return self._collate_idx(idx)

    def loss(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        from speclab.train.rec_align import rec_align_loss

        return rec_align_loss(model, batch, self.loss_name, self.alpha, self.k)

    def tokens_in(self, batch: dict) -> int:
        return sum(int(b["inputs"].numel()) for b in batch.values())

    @torch.no_grad()
    def validate(self, model: torch.nn.Module) -> float:
        """L_Rec on held-out validation examples: comparable across losses and alphas
        (the alignment loss itself is scaled by alpha), so ASHA can rank drafters."""
        model.eval()
        out = float(RecTask.loss(self, model, self._collate(self.val[: self.tr.batch_size * 4])))
        model.train()
        return out


class HeadTask:
    """SpecDec++ acceptance head (``head``) on ``accept`` shards with the frozen drafter
    ``draft`` (a local folder); the last shard is held out."""

    def __init__(self, cfg: HeadTaskConfig, data_dir: Path, device: torch.device) -> None:
        from speclab.models.loading import load_model
        from speclab.train.head import DraftFeatures

        self.tr, self.h, self.device = cfg.train, cfg.head, device
        shards = sorted((Path(data_dir) / "accept").glob("shard-*.parquet"))
        if len(shards) < 2:
            raise ValueError(f"head: need >= 2 accept shards (one is held out), found "
                             f"{len(shards)} in {data_dir}")
        self.val = pq.read_table(shards[-1]).to_pylist()
        self.train = [r for s in shards[:-1] for r in pq.read_table(s).to_pylist()]
        self.features = DraftFeatures(load_model(cfg.draft, field="models.draft").to(device))

    def build_model(self) -> torch.nn.Module:
        from speclab.decoding.acceptance_head import AcceptanceHead

        return AcceptanceHead(self.features.hidden_size, self.h.depth)

    def _batch(self, rows: list[dict], g: torch.Generator) -> dict:
        from speclab.train.head import mixed_batch

        return mixed_batch(rows, self.features, self.h.mix_ratio, g, self.device)

    def batch(self, step: int, rank: int) -> dict:
        g = _gen(self.tr.seed, step, rank)
        idx = torch.randint(0, len(self.train), (self.tr.batch_size,), generator=g).tolist()
        return self._batch([self.train[i] for i in idx], g)

    def loss(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        from speclab.losses import weighted_bce

        return weighted_bce(model(batch["hidden"]), batch["p"], batch["mask"],
                            self.h.w_acc, self.h.w_rej)

    def tokens_in(self, batch: dict) -> int:
        return int(batch["mask"].sum())

    @torch.no_grad()
    def validate(self, model: torch.nn.Module) -> float:
        model.eval()
        g = torch.Generator().manual_seed(self.tr.seed)
        out = float(self.loss(model, self._batch(self.val[: self.tr.batch_size * 4], g)))
        model.train()
        return out


class EagleTask:
    """An EAGLE feature drafter on ``feat`` shards (``feat_tree`` for TALF; the last
    shard held out), from scratch or from the drafter in ``eagle.init_from``."""

    def __init__(self, cfg: EagleTaskConfig, data_dir: Path, device: torch.device) -> None:
        from speclab.pipelines.eagle import data_kind_of

        self.tr, self.e, self.target, self.device = cfg.train, cfg.eagle, cfg.target, device
        self.kind = data_kind_of(self.e.loss, self.e.version)
        shards = sorted((Path(data_dir) / self.kind).glob("shard-*.parquet"))
        if len(shards) < 2:
            raise ValueError(f"distill: need >= 2 {self.kind} shards (one is held out), "
                             f"found {len(shards)} in {Path(data_dir) / self.kind}")
        self.val = pq.read_table(shards[-1]).to_pylist()
        self.train = [r for s in shards[:-1] for r in pq.read_table(s).to_pylist()]

    def build_model(self) -> torch.nn.Module:
        from speclab.models.eagle import EagleModel, load_init
        from speclab.models.eagle3 import Eagle3Model
        from speclab.models.loading import load_model

        # the target on the worker's device: the engine probe feeds it the drafter's inputs
        self.target_model = load_model(self.target, field="models.target").to(self.device)
        e = self.e
        if e.version == 3:  # the draft vocabulary: the data's most frequent target tokens
            ids = draft_vocabulary(self.train, e.draft_vocab) if e.draft_vocab else None
            model = Eagle3Model.from_target(self.target_model, e.feature_layers, ids).float()
        else:
            model = EagleModel.from_target(self.target_model, e.layers, e.norms,
                                           e.norms).float()
        if e.init_from:
            start = load_init(e.init_from, self.target_model.config, e)
            model.load_state_dict(start.float().state_dict())
        return model

    def _collate(self, rows: list[dict], g: torch.Generator) -> dict:
        from speclab.train.eagle import collate_feat, collate_forest

        if self.kind.endswith("_tree"):  # eagle.talf_roots trees per window, drawn with g
            batch = collate_forest(rows, self.e.talf_roots, g)
        else:
            batch = collate_feat(rows)
        return {k: v.to(self.device) for k, v in batch.items()}

    def batch(self, step: int, rank: int) -> dict:
        """A training batch; ``eagle`` / ``hass`` carry EAGLE's uniform ``feature_noise``
        for the features the drafter reads (drawn with the step's generator)."""
        from speclab.train.eagle import feature_noise

        g = _gen(self.tr.seed, step, rank)
        idx = torch.randint(0, len(self.train), (self.tr.batch_size,), generator=g).tolist()
        batch = self._collate([self.train[i] for i in idx], g)
        if self.e.loss in ("eagle", "hass") and self.e.feature_noise > 0:
            batch["feature_noise"] = feature_noise(
                batch["features"].shape, self.e.feature_noise, self.e.feature_noise_len,
                g).to(self.device)
        return batch

    def _val_batch(self) -> dict:
        """The held-out windows (a fixed draw of TALF roots; no feature noise)."""
        return self._collate(self.val[: self.tr.batch_size * 4], _gen(self.tr.seed, -1, 0))

    def loss(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        from speclab.train.eagle import eagle3_loss, eagle_loss, talf_loss

        e = self.e
        if e.loss == "talf":
            return talf_loss(model, batch)
        if e.loss == "eagle3":
            return eagle3_loss(model, batch, e.ttt_steps, e.ttt_decay)
        return eagle_loss(model, batch, e.loss, e.w_reg, e.w_cls, e.hass_k, e.hass_steps,
                          e.w_topk, e.hass_detach, e.hass_reduce)

    def tokens_in(self, batch: dict) -> int:
        return int(batch["tokens"].numel())

    @torch.no_grad()
    def validate(self, model: torch.nn.Module) -> float:
        """The training loss on held-out windows."""
        model.eval()
        out = float(self.loss(model, self._val_batch()))
        model.train()
        return out

    @torch.no_grad()
    def val_metrics(self, model: torch.nn.Module) -> dict[str, float]:
        """``val_top1``: the drafter's argmax equals the target's (teacher features), and
        the engine's own figures with this drafter (:func:`engine_acceptance`)."""
        from speclab.train.eagle import engine_acceptance, top1_agreement

        model.eval()
        out = {"val_top1": top1_agreement(model, self._val_batch())}
        if self.e.engine_prompts:
            prompts = [r["tokens"][: len(r["tokens"]) // 2]
                       for r in self.val[: self.e.engine_prompts]]
            out.update(engine_acceptance(self.target_model, model, prompts,
                                         self.e.engine_tokens))
        model.train()
        return out


def draft_vocabulary(rows: list[dict], size: int) -> torch.Tensor:
    """EAGLE-3's draft vocabulary: the ``size`` target tokens most frequent in the
    training ``rows`` (``feat`` rows: the target's top-1 prediction at every position,
    then the window's tokens), ties to the lower id, then the lowest unseen ids; ``[size]``
    ascending. Every rank computes the same from the same rows."""
    from collections import Counter

    counts: Counter = Counter()
    for r in rows:
        counts.update(int(ids[0]) for ids in r["topk_ids"])
    seen = Counter(int(t) for r in rows for t in r["tokens"])
    ranked = sorted(set(counts) | set(seen), key=lambda t: (-counts[t], -seen[t], t))
    chosen = ranked[:size]
    t = 0
    while len(chosen) < size:  # fewer distinct tokens than the vocabulary asked for
        if t not in counts and t not in seen:
            chosen.append(t)
        t += 1
    return torch.tensor(sorted(chosen), dtype=torch.long)


class MedusaTask:
    """Medusa heads on ``medusa`` shards (the last one held out). MEDUSA-1 trains
    :class:`~speclab.models.medusa.MedusaHeads` on the stored features; MEDUSA-2 a
    :class:`~speclab.train.medusa.Medusa2Model` (a copy of the target with the heads),
    with two parameter groups (heads at ``train.lr``, backbone at ``backbone_lr_scale``
    of it) and the heads-only warm-up."""

    def __init__(self, cfg: MedusaTaskConfig, data_dir: Path, device: torch.device) -> None:
        self.tr, self.m, self.variant = cfg.train, cfg.medusa, cfg.variant
        self.target, self.device = cfg.target, device
        self.prompt_len = cfg.prompt_len  # labels before it are corpus text
        self.first_label = 0 if self.m.prompt_labels else cfg.prompt_len  # the heads' loss
        # MEDUSA-2's backbone gets no gradient during the warm-up (DDP must allow it)
        self.unused_parameters = self.variant == "medusa2" and self.m.heads_warmup > 0
        shards = sorted((Path(data_dir) / "medusa").glob("shard-*.parquet"))
        if len(shards) < 2:
            raise ValueError(f"distill: need >= 2 medusa shards (one is held out), "
                             f"found {len(shards)} in {Path(data_dir) / 'medusa'}")
        self.val = pq.read_table(shards[-1]).to_pylist()
        self.train = [r for s in shards[:-1] for r in pq.read_table(s).to_pylist()]
        length = len(self.val[0]["tokens"]) if self.val else 0
        if self.prompt_len + 2 > length:
            raise ValueError(f"distill.prompt_len: {self.prompt_len} leaves no continuation "
                             f"label in medusa rows of {length} tokens")

    def build_model(self) -> torch.nn.Module:
        from speclab.models.loading import load_model
        from speclab.models.medusa import MedusaHeads
        from speclab.train.medusa import Medusa2Model

        # MEDUSA-1 validates on the target's features of the worker's device tokens
        self.target_model = load_model(self.target, field="models.target").float().to(
            self.device)
        heads = MedusaHeads.from_target(self.target_model, self.target, self.m.heads).float()
        if self.variant == "medusa1":
            return heads
        return Medusa2Model(load_model(self.target, field="models.target").float(), heads)

    def param_groups(self, model: torch.nn.Module) -> list[dict]:
        """MEDUSA-2: the heads at ``train.lr``, the backbone at ``backbone_lr_scale`` of it."""
        if self.variant == "medusa1":
            return [{"params": list(model.parameters()), "lr_scale": 1.0}]
        return [{"params": list(model.heads.parameters()), "lr_scale": 1.0},
                {"params": list(model.backbone.parameters()),
                 "lr_scale": self.m.backbone_lr_scale}]

    def _collate(self, rows: list[dict]) -> dict:
        from speclab.train.eagle import collate_feat

        return {k: v.to(self.device) for k, v in collate_feat(rows).items()}

    def batch(self, step: int, rank: int) -> dict:
        g = _gen(self.tr.seed, step, rank)
        idx = torch.randint(0, len(self.train), (self.tr.batch_size,), generator=g).tolist()
        out = self._collate([self.train[i] for i in idx])
        out["frozen"] = step < self.m.heads_warmup
        return out

    def loss(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        from speclab.train.medusa import medusa1_loss, medusa2_loss

        if self.variant == "medusa1":
            return medusa1_loss(model, batch, self.m.decay, self.first_label)
        return medusa2_loss(model, batch, self.m.decay, self.m.lambda0, self.m.lm_loss,
                            bool(batch.get("frozen", False)), self.first_label)

    def tokens_in(self, batch: dict) -> int:
        return int(batch["tokens"].numel())

    def _parts(self, model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
        """(the target as it is now, the heads)."""
        if self.variant == "medusa1":
            return self.target_model, model
        return model.backbone, model.heads

    def features(self, model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        """The current target's features ``[B, L, H]`` at ``tokens[:, :-1]``."""
        target, _ = self._parts(model)
        return target.model(input_ids=tokens[:, :-1]).last_hidden_state

    @torch.no_grad()
    def validate(self, model: torch.nn.Module) -> float:
        """The training loss on held-out sequences (MEDUSA-2: past the warm-up's)."""
        model.eval()
        val = self._collate(self.val[: self.tr.batch_size * 4])
        out = float(self.loss(model, val))
        model.train()
        return out

    @torch.no_grad()
    def val_metrics(self, model: torch.nn.Module) -> dict[str, float]:
        """``val_head<k>_top1`` (head ``k``'s calibration accuracy at rank 0 on the held-out
        sequences' continuations: the target's own tokens) and the engine's figures with
        the sparse tree built from them."""
        from speclab.drafters.medusa import MedusaDrafter
        from speclab.drafters.medusa_trees import sparse_template
        from speclab.train.engine_probe import engine_figures
        from speclab.train.medusa import own_token_accuracies

        model.eval()
        target, heads = self._parts(model)
        val = self._collate(self.val[: self.tr.batch_size * 4])
        acc = own_token_accuracies(heads, self.features(model, val["tokens"]), val["tokens"],
                                   self.m.calibration_top, self.prompt_len)
        out = {f"val_head{k}_top1": a[0] for k, a in enumerate(acc, start=1)}
        if self.m.engine_prompts:
            template = sparse_template(acc, self.m.sparse_nodes)
            prompts = [r["tokens"][: len(r["tokens"]) // 2]
                       for r in self.val[: self.m.engine_prompts]]
            out.update(engine_figures(target, lambda: MedusaDrafter(heads, template), prompts,
                                      self.m.engine_tokens, self.m.heads))
        model.train()
        return out


TASKS = {"lm": LMTask, "distill": DistillTask, "rec": RecTask, "rec_align": RecAlignTask,
         "head": HeadTask, "eagle": EagleTask, "medusa": MedusaTask}

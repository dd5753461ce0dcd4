"""The EAGLE family's Ray Train task: an EAGLE-1/2 or EAGLE-3 feature drafter on the
target's ``feat`` / ``feat3`` shards (TALF: ``*_tree``), its objective looked up in the
objective registry (:mod:`speclab.families.eagle.objectives`)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Literal

import pyarrow.parquet as pq
import torch

from speclab.config.schema import ArchConfig, EagleTrainConfig
from speclab.decoding.features import FeatureHooks
from speclab.families.eagle.model import EagleModel, load_init
from speclab.families.eagle.model3 import Eagle3Model
from speclab.families.eagle.training import (
    collate_feat,
    collate_forest,
    engine_acceptance,
    online_feat_batch,
    scored_mask,
    top1_agreement,
)
from speclab.families.objectives import objective
from speclab.families.spec import load
from speclab.models.loading import load_model
from speclab.train.distill_data import fused_spec
from speclab.train.tasks import (
    TaskBase,
    TaskConfigBase,
    global_batch_rows,
    register_task,
    step_generator,
    val_count,
)


class EagleTaskConfig(TaskConfigBase):
    """An EAGLE drafter for the target in local folder ``target`` (its embedding and LM
    head are copied and frozen)."""

    kind: Literal["eagle"] = "eagle"
    arch: ArchConfig | None = None
    eagle: EagleTrainConfig = EagleTrainConfig()
    target: str


class EagleTask(TaskBase):
    """An EAGLE feature drafter on ``feat`` shards (``feat_tree`` for TALF; the last
    shard held out), or on ``windows`` shards with the target's features computed in
    each step (``eagle.features: online``), from scratch or from the drafter in
    ``eagle.init_from``."""

    def __init__(self, cfg: EagleTaskConfig, data_dir: Path, device: torch.device) -> None:
        self.tr, self.e, self.target, self.device = cfg.train, cfg.eagle, cfg.target, device
        self.objective = objective(self.e.loss, "eagle", "eagle.loss")
        self.kind = self.objective.kind_for(self.e)
        shards = sorted((Path(data_dir) / self.kind).glob("shard-*.parquet"))
        if len(shards) < 2:
            raise ValueError(f"distill: need >= 2 {self.kind} shards (one is held out), "
                             f"found {len(shards)} in {Path(data_dir) / self.kind}")
        self.val = pq.read_table(shards[-1]).to_pylist()
        self.train = [r for s in shards[:-1] for r in pq.read_table(s).to_pylist()]
        self._hooks = None  # online features: hooks on the target, made on first use
        self._teacher_ids: torch.Tensor | None = None  # EAGLE-3's teacher vocab (build_model)

    def build_model(self) -> torch.nn.Module:
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
        # EAGLE-3's teacher over the draft vocabulary, computed with the online features
        self._teacher_ids = model.draft_ids.clone() if e.version == 3 and \
            self.kind == "windows" and e.teacher == "draft_vocab" else None
        return model

    def _collate(self, rows: list[dict], g: torch.Generator) -> dict:
        if self.kind.endswith("_tree"):  # eagle.talf_roots trees per window, drawn with g
            batch = collate_forest(rows, self.e.talf_roots, g)
        elif self.kind == "windows":  # online: the target computes the features now
            if self._hooks is None:
                self._hooks = FeatureHooks(self.target_model)
            spec = fused_spec(self.e) if self.e.version == 3 else None
            batch = online_feat_batch(self.target_model, rows, self.e.online_top_k, spec,
                                      self._hooks, self._teacher_ids)
        else:
            batch = collate_feat(rows)
        return {k: v.to(self.device) for k, v in batch.items()}

    def batch(self, step: int, rank: int) -> dict:
        """A training batch (:func:`global_batch_rows`: the same global batch on any
        number of workers), with what the objective adds to it (``eagle`` / ``hass``:
        EAGLE's uniform ``feature_noise`` for the features the drafter reads, drawn with
        the rank's generator)."""
        idx, g = global_batch_rows(self.tr.seed, step, rank, len(self.train), self.tr.batch_size)
        batch = self._collate([self.train[i] for i in idx], g)
        if self.objective.extras:
            extra = load(self.objective.extras)(self.e, batch, g)
            batch.update({k: v.to(self.device) for k, v in extra.items()})
        return batch

    def _val_batch(self) -> dict:
        """The held-out windows (a fixed draw of TALF roots; no feature noise)."""
        return self._collate(self.val[: val_count(self.tr.batch_size)],
                             step_generator(self.tr.seed, -1, 0))

    def loss(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        return self.objective.compute(model, batch, self.e)

    def tokens_in(self, batch: dict) -> int:
        return int(batch["tokens"].numel())

    def scored(self, batch: dict) -> float | None:
        """The pairs the loss covers (:func:`scored_mask`: the loss mask times EAGLE-3's
        teacher mask where the batch has them); None when neither masks anything."""
        m = scored_mask(batch, batch["tokens"].shape[1] - 2)
        return None if m is None else float(m.sum())

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
    """EAGLE-3's draft vocabulary: the ``size`` tokens most frequent in the training
    ``rows``, counted as EAGLE-3's ``traineagle3`` counts them (the tokens the loss covers:
    under a row's ``loss_mask``, a conversation's assistant tokens; every token of a row
    without one); ties to the token the target predicts first more often (``feat`` rows'
    top-1), then to the lower id; then the lowest unseen ids; ``[size]`` ascending. Every
    rank computes the same from the same rows."""
    counts: Counter = Counter()
    top1: Counter = Counter()
    for r in rows:
        mask = r.get("loss_mask")
        counts.update(int(t) for i, t in enumerate(r["tokens"]) if mask is None or mask[i])
        top1.update(int(ids[0]) for ids in r.get("topk_ids") or ())  # online: none
    ranked = sorted(set(counts) | set(top1), key=lambda t: (-counts[t], -top1[t], t))
    chosen = ranked[:size]
    t = 0
    while len(chosen) < size:  # fewer distinct tokens than the vocabulary asked for
        if t not in counts and t not in top1:
            chosen.append(t)
        t += 1
    return torch.tensor(sorted(chosen), dtype=torch.long)


register_task(EagleTaskConfig, EagleTask)

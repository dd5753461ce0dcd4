"""The Medusa family's Ray Train task: Medusa heads on the target's ``medusa`` shards,
MEDUSA-1 (frozen backbone) or MEDUSA-2 (heads plus backbone), the variant's objective
looked up in the objective registry (:mod:`speclab.families.medusa.objectives`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pyarrow.parquet as pq
import torch
from pydantic import Field

from speclab.config.schema import ArchConfig, MedusaTrainConfig
from speclab.decoding.features import FeatureHooks
from speclab.families.eagle.training import collate_feat, online_feat_batch
from speclab.families.medusa.drafter import MedusaDrafter
from speclab.families.medusa.model import MedusaHeads
from speclab.families.medusa.training import Medusa2Model, own_token_accuracies
from speclab.families.medusa.trees import sparse_template
from speclab.families.objectives import objective
from speclab.models.loading import load_model
from speclab.train.engine_probe import engine_figures
from speclab.train.tasks import TaskBase, TaskConfigBase, register_task, step_generator, val_count


class MedusaTaskConfig(TaskConfigBase):
    """Medusa heads for the target in local folder ``target``: ``variant`` ``medusa1``
    (frozen backbone) or ``medusa2`` (joint fine-tuning). ``prompt_len``: the corpus
    prompt's tokens at the start of every row (``distill.prompt_len``): labels there are
    not the target's own, so calibration (and, unless ``medusa.prompt_labels``, the heads'
    loss) skips them."""

    kind: Literal["medusa"] = "medusa"
    arch: ArchConfig | None = None
    medusa: MedusaTrainConfig = MedusaTrainConfig()
    variant: str = "medusa1"
    target: str
    prompt_len: int = Field(0, ge=0)


class MedusaTask(TaskBase):
    """Medusa heads on ``medusa`` shards (the last one held out), or on
    ``medusa_windows`` shards with the target's features computed in each step
    (``medusa.features: online``). MEDUSA-1 trains
    :class:`~speclab.families.medusa.model.MedusaHeads` on the stored features; MEDUSA-2 a
    :class:`~speclab.families.medusa.training.Medusa2Model` (a copy of the target with the heads),
    with two parameter groups (heads at ``train.lr``, backbone at ``backbone_lr_scale``
    of it) and the heads-only warm-up."""

    def __init__(self, cfg: MedusaTaskConfig, data_dir: Path, device: torch.device) -> None:
        self.tr, self.m, self.variant = cfg.train, cfg.medusa, cfg.variant
        self.objective = objective(cfg.variant, "medusa", "variant")
        self.target, self.device = cfg.target, device
        self.prompt_len = cfg.prompt_len  # labels before it are corpus text
        self.first_label = 0 if self.m.prompt_labels else cfg.prompt_len  # the heads' loss
        # MEDUSA-2's backbone gets no gradient during the warm-up (DDP must allow it)
        self.unused_parameters = self.variant == "medusa2" and self.m.heads_warmup > 0
        self.kind = self.objective.kind_for(self.m)  # medusa, or medusa_windows (online)
        shards = sorted((Path(data_dir) / self.kind).glob("shard-*.parquet"))
        if len(shards) < 2:
            raise ValueError(f"distill: need >= 2 {self.kind} shards (one is held out), "
                             f"found {len(shards)} in {Path(data_dir) / self.kind}")
        self._hooks = None  # online features: hooks on the frozen target, made on first use
        self.val = pq.read_table(shards[-1]).to_pylist()
        self.train = [r for s in shards[:-1] for r in pq.read_table(s).to_pylist()]
        length = len(self.val[0]["tokens"]) if self.val else 0
        if self.prompt_len + 2 > length:
            raise ValueError(f"distill.prompt_len: {self.prompt_len} leaves no continuation "
                             f"label in medusa rows of {length} tokens")

    def build_model(self) -> torch.nn.Module:
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
        """The rows' tensors (:func:`collate_feat`'s); online, the frozen original target
        computes the features and top-k now (MEDUSA-2's KL is from it, not from the
        backbone being tuned)."""
        if self.kind == "medusa_windows":
            if self._hooks is None:
                self._hooks = FeatureHooks(self.target_model)
            batch = online_feat_batch(self.target_model, rows, self.m.online_top_k, None,
                                      self._hooks)
        else:
            batch = collate_feat(rows)
        return {k: v.to(self.device) for k, v in batch.items()}

    def batch(self, step: int, rank: int) -> dict:
        g = step_generator(self.tr.seed, step, rank)
        idx = torch.randint(0, len(self.train), (self.tr.batch_size,), generator=g).tolist()
        out = self._collate([self.train[i] for i in idx])
        out["frozen"] = step < self.m.heads_warmup
        return out

    def loss(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        return self.objective.compute(model, {**batch, "first_label": self.first_label},
                                      self.m)

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
        val = self._collate(self.val[: val_count(self.tr.batch_size)])
        out = float(self.loss(model, val))
        model.train()
        return out

    @torch.no_grad()
    def val_metrics(self, model: torch.nn.Module) -> dict[str, float]:
        """``val_head<k>_top1`` (head ``k``'s calibration accuracy at rank 0 on the held-out
        sequences' continuations: the target's own tokens) and the engine's figures with
        the sparse tree built from them."""
        model.eval()
        target, heads = self._parts(model)
        val = self._collate(self.val[: val_count(self.tr.batch_size)])
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


register_task(MedusaTaskConfig, MedusaTask)

"""The AtSpeed family's Ray Train task: a recommendation drafter trained with its
objective (AtSpeed-S / -R or a KD baseline, :mod:`speclab.families.atspeed.objectives`)
on the target's alignment data."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from pydantic import Field

from speclab.families.atspeed.training import collate_align
from speclab.families.objectives import objective
from speclab.train.tasks import (
    RecTask,
    TaskConfigBase,
    register_task,
    step_generator,
    val_count,
)


class RecAlignTaskConfig(TaskConfigBase):
    """One AtSpeed-style drafter: its ``loss`` and AtSpeed weight ``align_alpha``."""

    kind: Literal["rec_align"] = "rec_align"
    loss: str = "sft"
    align_alpha: float = Field(0.5, ge=0.0, le=1.0)
    align_k: int = Field(5, gt=0)


class RecAlignTask(RecTask):
    """A recommendation drafter trained with ``loss`` (sft, seq_kd, word_kd, tvd_kd,
    atspeed_s, atspeed_r) on the target's alignment data (``align.pt``: one row per
    training example, see :mod:`speclab.families.atspeed.training`)."""

    def __init__(self, cfg: RecAlignTaskConfig, data_dir: Path, device: torch.device) -> None:
        super().__init__(cfg, data_dir, device)
        self.rows = torch.load(Path(data_dir) / "align.pt", weights_only=False)
        self.train = self.train[: len(self.rows)]
        self.loss_name = cfg.loss
        self.objective = objective(cfg.loss, "atspeed", "rec_eval.draft_loss")
        self.alpha = cfg.align_alpha
        self.k = cfg.align_k

    def _collate_idx(self, idx: list[int]) -> dict:
        batch = collate_align([self.rows[i] for i in idx], [self.train[i] for i in idx],
                              self.meta, self.loss_name)
        return {part: {k: v.to(self.device) for k, v in b.items()}
                for part, b in batch.items()}

    def batch(self, step: int, rank: int) -> dict:
        g = step_generator(self.tr.seed, step, rank)
        idx = torch.randint(0, len(self.rows), (self.tr.batch_size,), generator=g).tolist()
        return self._collate_idx(idx)

    def loss(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        return self.objective.compute(model, batch, self)

    def tokens_in(self, batch: dict) -> int:
        return sum(int(b["inputs"].numel()) for b in batch.values())

    @torch.no_grad()
    def validate(self, model: torch.nn.Module) -> float:
        """L_Rec on held-out validation examples: comparable across losses and alphas
        (the alignment loss itself is scaled by alpha), so ASHA can rank drafters."""
        model.eval()
        val = self._collate(self.val[: val_count(self.tr.batch_size)])
        out = float(RecTask.loss(self, model, val))
        model.train()
        return out


register_task(RecAlignTaskConfig, RecAlignTask)

"""The SpecDec++ family's Ray Train task: an acceptance head on ``accept`` shards with
the frozen draft LM's features, weighted BCE (SpecDec++ section 3.3)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pyarrow.parquet as pq
import torch

from speclab.config.schema import ArchConfig, HeadConfig
from speclab.decoding.acceptance_head import AcceptanceHead
from speclab.families.specdecpp.training import DraftFeatures, mixed_batch
from speclab.losses import weighted_bce
from speclab.models.loading import load_model
from speclab.train.tasks import TaskBase, TaskConfigBase, register_task, step_generator, val_count


class HeadTaskConfig(TaskConfigBase):
    """An acceptance head on the frozen drafter in local folder ``draft``."""

    kind: Literal["head"] = "head"
    arch: ArchConfig | None = None
    head: HeadConfig = HeadConfig()
    draft: str


class HeadTask(TaskBase):
    """SpecDec++ acceptance head (``head``) on ``accept`` shards with the frozen drafter
    ``draft`` (a local folder); the last shard is held out."""

    def __init__(self, cfg: HeadTaskConfig, data_dir: Path, device: torch.device) -> None:
        self.tr, self.h, self.device = cfg.train, cfg.head, device
        shards = sorted((Path(data_dir) / "accept").glob("shard-*.parquet"))
        if len(shards) < 2:
            raise ValueError(f"head: need >= 2 accept shards (one is held out), found "
                             f"{len(shards)} in {data_dir}")
        self.val = pq.read_table(shards[-1]).to_pylist()
        self.train = [r for s in shards[:-1] for r in pq.read_table(s).to_pylist()]
        self.features = DraftFeatures(load_model(cfg.draft, field="models.draft").to(device))

    def build_model(self) -> torch.nn.Module:
        return AcceptanceHead(self.features.hidden_size, self.h.depth)

    def _batch(self, rows: list[dict], g: torch.Generator) -> dict:
        return mixed_batch(rows, self.features, self.h.mix_ratio, g, self.device)

    def batch(self, step: int, rank: int) -> dict:
        g = step_generator(self.tr.seed, step, rank)
        idx = torch.randint(0, len(self.train), (self.tr.batch_size,), generator=g).tolist()
        return self._batch([self.train[i] for i in idx], g)

    def loss(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        return weighted_bce(model(batch["hidden"]), batch["p"], batch["mask"],
                            self.h.w_acc, self.h.w_rej)

    def tokens_in(self, batch: dict) -> int:
        return int(batch["mask"].sum())

    @torch.no_grad()
    def validate(self, model: torch.nn.Module) -> float:
        model.eval()
        g = torch.Generator().manual_seed(self.tr.seed)
        out = float(self.loss(model, self._batch(self.val[: val_count(self.tr.batch_size)], g)))
        model.train()
        return out


register_task(HeadTaskConfig, HeadTask)

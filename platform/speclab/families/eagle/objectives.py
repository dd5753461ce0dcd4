"""The EAGLE family's objectives: typed knobs and registry entries.

``eagle`` (EAGLE-1/2: feature regression + soft cross-entropy), ``hass`` (HASS: the same
plus top-K distillation, over ``steps`` harmonised steps), ``talf`` (TALF: cross-entropy
over target-built trees) and ``eagle3`` (EAGLE-3's training-time test). Each reads only
its own knobs from the ``eagle`` group (:class:`speclab.families.objectives.Objective`);
the losses themselves are in :mod:`speclab.families.eagle.training`.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from speclab.config.base import StrictModel
from speclab.families.eagle import training
from speclab.families.objectives import Objective, register_objective

_HERE = "speclab.families.eagle.objectives"


class EagleKnobs(StrictModel):
    """EAGLE-1/2: ``w_reg * smooth-L1(f_hat, f) + w_cls * CE`` with EAGLE's feature noise."""

    w_reg: float = Field(1.0, ge=0.0)
    w_cls: float = Field(0.1, ge=0.0)
    feature_noise: float = Field(0.2, ge=0.0)
    feature_noise_len: int = Field(512, gt=0)


class HassKnobs(EagleKnobs):
    """HASS: EAGLE's terms plus ``w_topk`` times the top-``k`` distillation, at each of
    ``steps`` harmonised steps (fed-back features detached unless not ``detach``)."""

    w_topk: float = Field(1.0, ge=0.0)
    k: int = Field(10, gt=0)
    steps: int = Field(3, gt=0)
    detach: bool = True
    reduce: Literal["sum", "mean"] = "sum"


class Eagle3Knobs(StrictModel):
    """EAGLE-3's training-time test: ``steps`` steps weighted ``decay ** (s - 1)``."""

    steps: int = Field(7, gt=0)
    decay: float = Field(0.8, gt=0.0, le=1.0)


def eagle_objective(model: torch.nn.Module, batch: dict, k: EagleKnobs) -> torch.Tensor:
    """EAGLE-1/2's loss on a ``feat`` batch (one step, no top-K term)."""
    return training.feature_loss(model, batch, w_reg=k.w_reg, w_cls=k.w_cls)


def hass_objective(model: torch.nn.Module, batch: dict, k: HassKnobs) -> torch.Tensor:
    """HASS's loss on a ``feat`` batch."""
    return training.feature_loss(model, batch, w_reg=k.w_reg, w_cls=k.w_cls, w_topk=k.w_topk,
                                 top_k=k.k, steps=k.steps, detach=k.detach, reduce=k.reduce)


def talf_objective(model: torch.nn.Module, batch: dict, k: None) -> torch.Tensor:
    """TALF's loss on a ``feat_tree`` / ``feat3_tree`` batch."""
    del k
    return training.talf_loss(model, batch)


def eagle3_objective(model: torch.nn.Module, batch: dict, k: Eagle3Knobs) -> torch.Tensor:
    """EAGLE-3's loss on a ``feat3`` batch."""
    return training.eagle3_loss(model, batch, k.steps, k.decay)


def feature_kind(group: Any) -> str:
    """``feat`` (last-layer features) or ``feat3`` (an EAGLE-3 drafter's fused layers)."""
    return "feat3" if group.version == 3 else "feat"


def tree_kind(group: Any) -> str:
    """TALF's kinds: the feature kind plus the target-built trees."""
    return f"{feature_kind(group)}_tree"


def noise(group: Any, batch: dict, generator: torch.Generator) -> dict:
    """EAGLE's uniform feature noise for the features a training batch reads."""
    if group.feature_noise <= 0:
        return {}
    return {"feature_noise": training.feature_noise(
        batch["features"].shape, group.feature_noise, group.feature_noise_len, generator)}


def last_layer_drafter(group: Any, name: str) -> None:
    """EAGLE's and HASS's regression needs an EAGLE-1/2 drafter (``version: 1``)."""
    if group.version == 3:
        raise ValueError(f"loss: {name!r} regresses the target's last-layer feature, which "
                         "an EAGLE-3 drafter (version 3) does not predict; use eagle3 or talf")


def eagle3_drafter(group: Any, name: str) -> None:
    """EAGLE-3's training-time test trains an EAGLE-3 drafter (``version: 3``)."""
    if group.version != 3:
        raise ValueError(f"loss: {name} trains an EAGLE-3 drafter; set eagle.version: 3")


def hass_within_top_k(group: Any, job: Any) -> None:
    """HASS distils the stored top-k: ``eagle.hass_k`` must not exceed ``distill.top_k``."""
    if group.hass_k > job.distill.top_k:
        raise ValueError(f"eagle.hass_k ({group.hass_k}) must not exceed "
                         f"distill.top_k ({job.distill.top_k}), the stored top-k")


def talf_within_window(group: Any, job: Any) -> None:
    """TALF's trees must fit in a training window."""
    if group.talf_depth >= job.distill.seq_len:
        raise ValueError(f"eagle.talf_depth ({group.talf_depth}) must be below "
                         f"distill.seq_len ({job.distill.seq_len})")


_FEATURES = {"w_reg": "w_reg", "w_cls": "w_cls", "feature_noise": "feature_noise",
             "feature_noise_len": "feature_noise_len"}

OBJECTIVES = (
    Objective("eagle", "eagle", f"{_HERE}:eagle_objective", f"{_HERE}:feature_kind",
              knobs=f"{_HERE}:EagleKnobs", fields=_FEATURES, check=f"{_HERE}:last_layer_drafter",
              extras=f"{_HERE}:noise", doc="EAGLE-1/2: feature regression + CE"),
    Objective("hass", "eagle", f"{_HERE}:hass_objective", f"{_HERE}:feature_kind",
              knobs=f"{_HERE}:HassKnobs",
              fields={**_FEATURES, "w_topk": "w_topk", "k": "hass_k", "steps": "hass_steps",
                      "detach": "hass_detach", "reduce": "hass_reduce"},
              check=f"{_HERE}:last_layer_drafter", validate=f"{_HERE}:hass_within_top_k",
              extras=f"{_HERE}:noise", doc="HASS: EAGLE + top-K distillation, n steps"),
    Objective("talf", "eagle", f"{_HERE}:talf_objective", f"{_HERE}:tree_kind",
              validate=f"{_HERE}:talf_within_window",
              doc="TALF: CE over every node of target-built trees"),
    Objective("eagle3", "eagle", f"{_HERE}:eagle3_objective", "feat3",
              knobs=f"{_HERE}:Eagle3Knobs", fields={"steps": "ttt_steps", "decay": "ttt_decay"},
              check=f"{_HERE}:eagle3_drafter", doc="EAGLE-3: training-time test"),
)
for _obj in OBJECTIVES:
    register_objective(_obj)

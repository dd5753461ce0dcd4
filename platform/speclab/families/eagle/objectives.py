"""The EAGLE family's objectives: their typed knobs, losses and checks (the registry
entries that name them are in the family's declaration, ``speclab.families.eagle``).

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


def noise(group: Any, batch: dict, generator: torch.Generator) -> dict:
    """EAGLE's uniform feature noise for the features a training batch reads."""
    if group.feature_noise <= 0:
        return {}
    return {"feature_noise": training.feature_noise(
        batch["features"].shape, group.feature_noise, group.feature_noise_len, generator)}

"""The Medusa family's objectives: MEDUSA-1 (heads on the frozen backbone,
``sum_k decay^k CE_k``) and MEDUSA-2 (joint fine-tuning: ``L_LM + lambda0 * L_MEDUSA-1``),
each reading only its own knobs from the ``medusa`` group; the losses are in
:mod:`speclab.families.medusa.training`."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from speclab.config.base import StrictModel
from speclab.families.medusa.training import medusa1_loss, medusa2_loss


class Medusa1Knobs(StrictModel):
    """MEDUSA-1: head ``k`` weighs ``decay ** k``."""

    decay: float = Field(0.8, gt=0.0, le=1.0)


class Medusa2Knobs(Medusa1Knobs):
    """MEDUSA-2: ``L_LM`` (``kl`` from the original's top-k + rest, or ``ce``) plus
    ``lambda0`` times MEDUSA-1's loss."""

    lambda0: float = Field(0.2, gt=0.0)
    lm_loss: Literal["kl", "ce"] = "kl"


def medusa1_objective(model: torch.nn.Module, batch: dict, k: Medusa1Knobs) -> torch.Tensor:
    """MEDUSA-1 on a ``medusa`` batch (``first_label``: the heads' first counted label)."""
    return medusa1_loss(model, batch, k.decay, batch.get("first_label", 0))


def medusa2_objective(model: torch.nn.Module, batch: dict, k: Medusa2Knobs) -> torch.Tensor:
    """MEDUSA-2 on a ``medusa`` batch (``frozen``: the heads-only warm-up)."""
    return medusa2_loss(model, batch, k.decay, k.lambda0, k.lm_loss,
                        bool(batch.get("frozen", False)), batch.get("first_label", 0))

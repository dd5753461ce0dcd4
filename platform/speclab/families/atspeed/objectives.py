"""The AtSpeed family's objectives: the recommendation drafter's losses on the target's
alignment data. ``sft`` (L_Rec only), the KD baselines ``seq_kd``, ``word_kd``,
``tvd_kd``, and AtSpeed's ``atspeed_s`` (L_Align-S, strict verification) and
``atspeed_r`` (L_Align-R, relaxed sampling), each mixed with L_Rec by ``alpha``
(:func:`speclab.families.atspeed.training.rec_align_loss`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from pydantic import Field

from speclab.config.base import StrictModel
from speclab.families.atspeed.training import rec_align_loss


class AlignKnobs(StrictModel):
    """``alpha``: the alignment loss's weight against L_Rec; ``k``: candidate tokens per
    position (AtSpeed's ``V_c``)."""

    alpha: float = Field(0.5, ge=0.0, le=1.0)
    k: int = Field(5, gt=0)


def _objective(name: str) -> Callable[[torch.nn.Module, dict, AlignKnobs], torch.Tensor]:
    def loss(model: torch.nn.Module, batch: dict, k: AlignKnobs) -> torch.Tensor:
        return rec_align_loss(model, batch, name, k.alpha, k.k)

    loss.__doc__ = f"``{name}`` on a :func:`collate_align` batch."
    return loss


sft_objective = _objective("sft")
seq_kd_objective = _objective("seq_kd")
word_kd_objective = _objective("word_kd")
tvd_kd_objective = _objective("tvd_kd")
atspeed_s_objective = _objective("atspeed_s")
atspeed_r_objective = _objective("atspeed_r")

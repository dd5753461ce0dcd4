"""SpecDec++ acceptance-prediction head (eq. 3.1) and its stopping rule.

The head reads the drafter's final hidden state ``e_i`` at a draft token ``Y_i`` (the
input of the drafter's LM head) and predicts ``P(Y_i accepted | Y_<i accepted)`` as
``sigmoid(f(e_i))``. ``f`` is a (D+1)-layer residual MLP with SiLU (section 4.1):
D blocks ``x + silu(W x)`` then a linear layer to one logit; D = 0 is a linear layer.

It is stored next to a drafter as ``acceptance_head.safetensors`` (weights) and
``acceptance_head.json`` (``hidden_size``, ``depth``, training facts).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

WEIGHTS = "acceptance_head.safetensors"
CONFIG = "acceptance_head.json"


class AcceptanceHead(nn.Module):
    """``[..., H]`` final hidden states -> ``[...]`` acceptance logits."""

    def __init__(self, hidden_size: int, depth: int = 0) -> None:
        super().__init__()
        if hidden_size < 1:
            raise ValueError(f"hidden_size: must be >= 1, got {hidden_size}")
        if depth < 0:
            raise ValueError(f"head.depth: must be >= 0, got {depth}")
        self.hidden_size, self.depth = hidden_size, depth
        self.blocks = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(depth))
        self.out = nn.Linear(hidden_size, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [..., H]`` -> logits ``[...]`` (``sigmoid`` gives P(accept))."""
        x = hidden.to(self.out.weight.dtype)
        for block in self.blocks:
            x = x + nn.functional.silu(block(x))
        return self.out(x).squeeze(-1)


def save_head(head: AcceptanceHead, folder: str | Path, extra: dict | None = None) -> Path:
    """Write the head's weights and config into ``folder`` (next to a drafter)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()},
              folder / WEIGHTS)
    meta = {"hidden_size": head.hidden_size, "depth": head.depth, **(extra or {})}
    (folder / CONFIG).write_text(json.dumps(meta, indent=2))
    return folder


def load_head(folder: str | Path, hidden_size: int | None = None,
              field: str = "head") -> AcceptanceHead:
    """Load a head saved by :func:`save_head`; checks it fits a drafter of ``hidden_size``."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / CONFIG).is_file() or not (folder / WEIGHTS).is_file():
        raise ValueError(f"{field}: no acceptance head in {str(folder)!r} "
                         f"(expected {CONFIG} and {WEIGHTS})")
    meta = json.loads((folder / CONFIG).read_text())
    if hidden_size is not None and meta["hidden_size"] != hidden_size:
        raise ValueError(f"{field}: the head reads hidden size {meta['hidden_size']} but the "
                         f"drafter's hidden size is {hidden_size}")
    head = AcceptanceHead(meta["hidden_size"], meta["depth"])
    head.load_state_dict(load_file(folder / WEIGHTS))
    return head.eval()


def should_stop(accept_probs: list[float], threshold: float) -> bool:
    """SpecDec++'s rule: stop once ``1 - prod(accept_probs) > threshold``."""
    keep = 1.0
    for p in accept_probs:
        keep *= p
    return 1.0 - keep > threshold

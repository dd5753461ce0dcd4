"""Logit warping shared by target and draft (so ``p`` and ``q`` are warped identically)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How next tokens are chosen.

    ``temperature == 0`` means greedy (the warped distribution is a one-hot argmax).
    ``top_k == 0`` and ``top_p == 1.0`` disable those filters.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"{name}: must be a finite number, got {value}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ValueError(f"top_k: must be an integer, got {self.top_k!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits into the sampling distribution.

    Args:
        logits: ``[..., V]`` raw logits.
        params: temperature / top-k / top-p.
    Returns:
        ``[..., V]`` float32 probabilities; one-hot argmax when ``temperature == 0``.
        Finite for every temperature the params accept (a tiny one gives the argmax, ties
        shared).
    """
    logits = logits.float()
    if params.greedy:
        out = torch.zeros_like(logits)
        out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        return out
    # shift the max to 0, then scale by 1/T (capped at float32's max): a temperature too
    # small to represent sends every other logit to -inf (greedy) instead of 0/0 = nan
    inverse = min(1.0 / params.temperature, torch.finfo(torch.float32).max)
    logits = (logits - logits.amax(-1, keepdim=True)) * inverse
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass strictly before it already reaches top_p
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= params.top_p
        drop_sorted[..., 0] = False  # the most probable token always stays (as in HF)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def draw(probs: torch.Tensor, n: int, generator: torch.Generator | None,
         replacement: bool = False) -> torch.Tensor:
    """``torch.multinomial`` with the draws made on the GENERATOR's device: a row's one
    generator is a CPU generator (its state travels between deployments as bytes), and
    torch refuses a CPU generator for CUDA probabilities.

    Args:
        probs: ``[V]`` or ``[N, V]`` probabilities, on any device.
    Returns:
        ``[n]`` / ``[N, n]`` token ids on ``probs``' device.
    """
    where = generator.device if generator is not None else probs.device
    out = torch.multinomial(probs.to(where), n, replacement=replacement, generator=generator)
    return out.to(probs.device)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from ``probs`` ``[V]`` (any device; see :func:`draw`)."""
    return int(draw(probs, 1, generator)[0])

"""Plain-PyTorch causal-LM training on a token stream (used directly and by Ray Train).

Losses: next-token cross-entropy, optionally mixed with word-level KD (forward KL to a
teacher's distribution), which aligns a drafter with its target.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class TrainSettings:
    """Optimisation settings for :func:`train_causal_lm`."""

    steps: int = 200
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    warmup: int = 20
    weight_decay: float = 0.01
    kd_weight: float = 0.0  # weight of KL(teacher || student); 0 = plain cross-entropy
    seed: int = 0


def random_windows(tokens: torch.Tensor, batch: int, seq_len: int, g: torch.Generator):
    """``[batch, seq_len + 1]`` random windows of the 1-D token stream ``tokens``."""
    starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch,), generator=g)
    return torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])


def lm_loss(
    model: torch.nn.Module,
    window: torch.Tensor,
    teacher: torch.nn.Module | None = None,
    kd_weight: float = 0.0,
) -> torch.Tensor:
    """Cross-entropy on ``window[:, 1:]`` (+ ``kd_weight`` * KL(teacher || model)).

    Args:
        window: ``[B, L + 1]`` token ids.
    """
    inputs, labels = window[:, :-1], window[:, 1:]
    logits = model(input_ids=inputs).logits  # [B, L, V]
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    if teacher is None or kd_weight == 0.0:
        return ce
    with torch.no_grad():
        t_logp = teacher(input_ids=inputs).logits.log_softmax(-1)  # [B, L, V]
    kl = F.kl_div(logits.log_softmax(-1), t_logp, log_target=True, reduction="batchmean")
    return (1 - kd_weight) * ce + kd_weight * kl / inputs.shape[1]


@torch.no_grad()
def eval_loss(model: torch.nn.Module, tokens: torch.Tensor, seq_len: int, max_windows: int = 32):
    """Mean next-token loss over consecutive windows of ``tokens`` ``[N]``."""
    model.eval()
    losses = []
    for i in range(min(max_windows, (tokens.numel() - 1) // seq_len)):
        w = tokens[i * seq_len : (i + 1) * seq_len + 1][None]
        losses.append(float(lm_loss(model, w)))
    model.train()
    return sum(losses) / max(len(losses), 1)


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, warmup: int,
                   steps: int, groups: list[dict] | None = None):
    """AdamW with linear warm-up then cosine decay to 10% of ``lr``. ``groups``: parameter
    groups ``{"params": [...], "lr_scale": s}``, each at ``s * lr`` on the same schedule
    (default: every parameter of ``model`` at ``lr``)."""
    groups = groups or [{"params": list(model.parameters()), "lr_scale": 1.0}]
    opt = torch.optim.AdamW([{"params": g["params"], "lr": lr * g["lr_scale"]} for g in groups],
                            lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        frac = (step - warmup) / max(steps - warmup, 1)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_at)


def train_causal_lm(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    settings: TrainSettings,
    teacher: torch.nn.Module | None = None,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Train ``model`` on random windows of ``tokens`` ``[N]``; returns per-step losses."""
    g = torch.Generator().manual_seed(settings.seed)
    torch.manual_seed(settings.seed)
    opt, sched = make_optimizer(model, settings.lr, settings.weight_decay, settings.warmup,
                                settings.steps)
    model.train()
    if teacher is not None:
        teacher.eval()
    losses = []
    for step in range(settings.steps):
        window = random_windows(tokens, settings.batch_size, settings.seq_len, g)
        loss = lm_loss(model, window, teacher, settings.kd_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
    model.eval()
    return losses

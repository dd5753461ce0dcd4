"""Wall clocks and peak memory that mean the same on a GPU as on a CPU (imports torch only).

On CUDA a kernel launch returns before the kernel ran, so a host clock read right after
a forward measures the launch, not the work, and the work lands in whichever later
figure first waits for the device. Every timed figure outside the decoding hot path
(benchmarks, engine figures during training, Serve's per-round split, the fast path's
warm-up) reads the clock through :func:`now`, which waits for the device first.
(The hot path itself times forwards with the runners' own clocks, which read the device
without a wait per forward: :mod:`speclab.decoding.runner`.)

:func:`peak_gpu_mb` is the GPU's counterpart of a process's peak RSS: the most memory
PyTorch's allocator held on the device since :func:`reset_peak_gpu` (NaN where the
models do not run on CUDA, so a table or an MLflow metric keeps the same keys on a CPU).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

import torch

from speclab.decoding.host import synchronize

T = TypeVar("T")

Device = torch.device | str | None


def _cuda(device: Device) -> torch.device | None:
    """The CUDA device meant by ``device``, or None when there is none to wait for.

    ``None``: the current CUDA device if this process has used CUDA, else no device."""
    if device is None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return torch.device("cuda", torch.cuda.current_device())
        return None
    device = torch.device(device)
    return device if device.type == "cuda" else None


def now(device: Device = None) -> float:
    """``time.perf_counter()`` after every kernel queued on ``device`` has run.

    ``device``: the device whose work is being timed (``"cuda"``, ``"cuda:1"``, a
    :class:`torch.device`); a CPU device reads the clock at once; None waits for the
    current CUDA device when this process has used CUDA."""
    cuda = _cuda(device)
    if cuda is not None:
        synchronize(cuda)
    return time.perf_counter()


def reset_peak_gpu(device: Device = None) -> None:
    """Start a new :func:`peak_gpu_mb` window on ``device`` (nothing off CUDA)."""
    cuda = _cuda(device)
    if cuda is not None:
        torch.cuda.reset_peak_memory_stats(cuda)


def peak_gpu_mb(device: Device = None) -> float:
    """MiB of GPU memory PyTorch's allocator held at most on ``device`` since the last
    :func:`reset_peak_gpu` (``torch.cuda.max_memory_allocated``); NaN when ``device`` is
    not a CUDA device (None: when this process has not used CUDA)."""
    cuda = _cuda(device)
    if cuda is None:
        return math.nan
    return torch.cuda.max_memory_allocated(cuda) / 2**20


def max_mb(a: float, b: float) -> float:
    """The larger of two peaks, NaN only when both are (an unmeasured peak is NaN)."""
    if math.isnan(a):
        return b
    if math.isnan(b):
        return a
    return max(a, b)


class TimedRunner(Protocol):
    """What :func:`split_forward_time` reads: a runner's total forward ``seconds`` (its own
    clock, synchronised on CUDA) and its ``device``."""

    seconds: float
    device: torch.device


def split_forward_time(runner: TimedRunner, call: Callable[[], T]) -> tuple[T, float, float]:
    """Run ``call()`` (work that includes forwards of ``runner``) and split its wall time.

    Returns ``(result, model_s, rest_s)``: ``model_s`` the seconds ``runner``'s forwards
    took during the call (its ``seconds`` counter), ``rest_s`` everything else the call
    did on the host (masks, rules, pruning, Python loops), never negative. Both clocks
    wait for ``runner.device`` before they are read."""
    s0, t0 = runner.seconds, now(runner.device)
    out = call()
    total = now(runner.device) - t0
    model_s = runner.seconds - s0
    return out, model_s, max(total - model_s, 0.0)

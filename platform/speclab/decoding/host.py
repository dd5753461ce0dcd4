"""The ONE place where the decoding hot path waits for the device.

On a GPU every device -> host read (``.item()``, ``.tolist()``, ``.cpu()``, ``int(t)``,
``float(t)``, ``bool(t)``) and every blocking copy is a synchronisation: the host stops
until every queued kernel has run. A round that reads per tree node or per row waits
tens of times; this module lets the engine wait a constant number of times per forward.

* :func:`fetch`: many device tensors to the host with ONE synchronisation (non-blocking
  copies into pinned memory, then one stream synchronise). Every device -> host read of
  the hot path goes through it, so :data:`SYNCS` counts them.
* :func:`to_device`: a host tensor (tokens, positions, masks built from Python lists) to
  the model's device without waiting (a non-blocking copy; the copy is staged before it
  returns, so the host tensor may be freed).
* :class:`ForwardClock`: forward timings without a synchronise per forward (CUDA events,
  read when the total is asked for).

Decision: a round waits once per model forward that a host-side choice depends on (the
verify forward's verdict; each draft forward's top tokens, which pick the next draft
level on the host), independent of the number of rows and tree nodes. Building a whole
dynamic tree on the device (as EAGLE-2's reference code does) would remove the draft
side's waits too; it is not done.
"""

from __future__ import annotations

import functools
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass
class SyncCounter:
    """Device -> host synchronisations made through this module (tests read it)."""

    syncs: int = 0


#: The process-wide count of :func:`fetch` / :func:`synchronize` calls.
SYNCS = SyncCounter()


def fetch(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Copy ``tensors`` (any shapes, any devices) to the host with ONE synchronisation.

    Returns plain CPU tensors in the same order (a CPU tensor comes back as itself).
    """
    if not tensors:
        return []
    SYNCS.syncs += 1
    plain = [t.detach() for t in tensors if type(t) is torch.Tensor and not t.is_cuda]
    if len(plain) == len(tensors):
        return plain  # plain host tensors: nothing to copy or wait for
    with torch._C.DisableTorchFunctionSubclass():
        cuda = [t.device for t in tensors if t.device.type == "cuda"]
        if not cuda:
            return [t.detach().as_subclass(torch.Tensor) for t in tensors]
        out = [t.detach().to("cpu", non_blocking=True) for t in tensors]
        for device in set(cuda):
            torch.cuda.current_stream(device).synchronize()
        return out


def fetch_lists(*tensors: torch.Tensor) -> list[list]:
    """:func:`fetch`, as nested Python lists (``tolist``) — one synchronisation."""
    return [t.tolist() for t in fetch(*tensors)]


def fetch_nested(items: list[torch.Tensor | tuple[torch.Tensor, ...]]
                 ) -> list[torch.Tensor | tuple[torch.Tensor, ...]]:
    """:func:`fetch` for a list whose items are tensors or tuples of tensors (e.g. one
    item per row of a batch): ONE synchronisation, the same structure on the host."""
    flat = [t for item in items for t in (item if isinstance(item, tuple) else (item,))]
    host = iter(fetch(*flat))
    return [tuple(next(host) for _ in item) if isinstance(item, tuple) else next(host)
            for item in items]


def synchronize(device: torch.device) -> None:
    """Wait for every kernel queued on ``device`` (counted; a no-op off CUDA)."""
    if device.type == "cuda":
        SYNCS.syncs += 1
        torch.cuda.synchronize(device)


def inference(fn: Callable) -> Callable:
    """``fn`` under inference mode, like ``@torch.inference_mode()`` at a third of its
    per-call cost (1.7 against 4.5 us measured here; 0.1 us when already inside): the
    engine calls its runners several times per round."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch._C._InferenceMode(True):
            return fn(*args, **kwargs)

    return wrapper


def longs(values: Sequence[int]) -> torch.Tensor:
    """``[len(values)]`` int64 host tensor of Python ints (token ids, positions), built
    from a typed buffer: a third of ``torch.tensor``'s time on a short list (measured;
    the engine builds several per round)."""
    if not len(values):
        return torch.zeros(0, dtype=torch.long)
    return torch.frombuffer(array("q", values), dtype=torch.long)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for the device (non-blocking copy)."""
    return t.to(device, non_blocking=True)


class ForwardClock:
    """Wall time of a model's forwards. On CUDA each forward is bracketed by two events
    and nothing waits until :attr:`seconds` is read (then once, counted by
    :data:`SYNCS`); elsewhere it is the host clock around the call."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._done = 0.0
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._t0: float | torch.cuda.Event = 0.0

    def start(self) -> None:
        """Mark the start of a forward."""
        if self.device.type == "cuda":
            self._t0 = torch.cuda.Event(enable_timing=True)
            self._t0.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        """Mark the end of the forward begun by :meth:`start`."""
        if self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((self._t0, end))
        else:
            self._done += time.perf_counter() - self._t0

    @property
    def seconds(self) -> float:
        """Total forward time so far (on CUDA: waits for the last recorded forward)."""
        if self._pending:
            synchronize(self.device)
            self._done += sum(a.elapsed_time(b) for a, b in self._pending) / 1000.0
            self._pending.clear()
        return self._done

    def take(self) -> float:
        """:attr:`seconds`, then start over from 0."""
        out, self._done = self.seconds, 0.0
        return out

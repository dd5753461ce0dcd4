"""Per-request state of a replica (a KV cache, a drafter), bounded in time and memory.

A request's state lives on one replica from its start to its end (:mod:`serve_apps.
router` routes every call of a request, or of its routing key, to the same replica). A
client that disconnects may never end it, so the store also frees:

* states idle longer than ``idle_timeout_s`` (checked on every store access), and
* the least recently used states when a new one would exceed ``max_sessions`` or the
  cached KV positions of all states would exceed ``max_cached_tokens``.

A step for a freed state fails with :class:`SessionGone` (only that request's step),
which the ingress turns into a 503 naming the request. Nothing here imports Ray.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import OrderedDict
from typing import Protocol

from speclab.timing import peak_gpu_mb


class State(Protocol):
    """What the store needs from a request's state."""

    def cached_tokens(self) -> int: ...

    def release(self) -> None: ...


class SessionGone(KeyError):
    """The request's state was never created here, ended, expired or was evicted."""

    def __str__(self) -> str:
        return str(self.args[0])


class SessionStore:
    """Request id -> state, in least-recently-used order; thread-safe."""

    def __init__(self, max_sessions: int, max_cached_tokens: int, idle_timeout_s: float,
                 clock=time.monotonic) -> None:
        self.max_sessions = max_sessions
        self.max_cached_tokens = max_cached_tokens
        self.idle_timeout_s = idle_timeout_s
        self.clock = clock
        self._states: OrderedDict[str, tuple[State, float]] = OrderedDict()
        self._lock = threading.Lock()
        self.expired = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._states)

    def cached_tokens(self) -> int:
        """KV positions held by every live state."""
        return sum(s.cached_tokens() for s, _ in self._states.values())

    def put(self, rid: str, state: State, release_old: bool = True) -> None:
        """Store a new request's state (replacing one with the same id; ``release_old``
        False: the old one was already released, e.g. a pool row restarted in place),
        then enforce the bounds, evicting least recently used OTHER states first."""
        with self._lock:
            if release_old:
                self._drop(rid)
            else:
                self._states.pop(rid, None)
            self._states[rid] = (state, self.clock())
            self._expire()
            while len(self._states) > 1 and (
                    len(self._states) > self.max_sessions
                    or self.cached_tokens() > self.max_cached_tokens):
                oldest = next(iter(self._states))
                self._drop(oldest)
                self.evicted += 1

    def get(self, rid: str) -> State:
        """The state of ``rid`` (marked as just used); :class:`SessionGone` if absent."""
        with self._lock:
            self._expire()
            if rid not in self._states:
                raise SessionGone(f"request {rid}: no state on this replica (it ended, was "
                                  f"idle more than {self.idle_timeout_s:g}s, or was evicted "
                                  f"by the memory bound)")
            state, _ = self._states.pop(rid)
            self._states[rid] = (state, self.clock())
            return state

    def end(self, rid: str) -> bool:
        """Free ``rid``'s state; False if it was already gone."""
        with self._lock:
            return self._drop(rid)

    def _drop(self, rid: str) -> bool:
        entry = self._states.pop(rid, None)
        if entry is None:
            return False
        entry[0].release()
        return True

    def _expire(self) -> None:
        now = self.clock()
        for rid in [r for r, (_, t) in self._states.items()
                    if now - t > self.idle_timeout_s]:
            self._drop(rid)
            self.expired += 1


class PoolRow:
    """A request's row in a replica's batched pool (:mod:`speclab.decoding.row_pool`), as
    the store sees it: releasing it takes the row out of the batch."""

    def __init__(self, pool, rid: str) -> None:
        self.pool, self.rid = pool, rid

    def cached_tokens(self) -> int:
        return self.pool.length(self.rid) if self.rid in self.pool else 0

    def release(self) -> None:
        self.pool.end(self.rid)


def _json_mb(mb: float) -> float | None:
    """A figure for a JSON body: None where it was not measured (NaN)."""
    return None if math.isnan(mb) else mb


def rss_mb() -> float:
    """Resident memory of this process in MiB (reported by the replicas' ``stats``)."""
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss / 2**20


class RequestStates:
    """Base of the model deployments: a :class:`SessionStore` from the ``serve`` bounds
    and the two calls every deployment answers the same way (``end``, ``stats``). Every
    method of a deployment is ``async``: they all run on the replica's event loop, one at
    a time between awaits, so the store and the batched pools need no lock (Serve may
    run plain ``def`` methods in a thread pool)."""

    def __init__(self, max_sessions: int, max_cached_tokens: int,
                 idle_timeout_s: float) -> None:
        self.sessions = SessionStore(max_sessions, max_cached_tokens, idle_timeout_s)

    async def end(self, rid: str) -> bool:
        """Free the request's state (False if it was already gone)."""
        return self.sessions.end(rid)

    async def stats(self, probe: str = "") -> dict:
        """Live requests, cached KV positions, frees so far, resident memory. ``probe``
        is routed like a request id, so different probes reach different replicas. A
        probe is a store access: states idle past the timeout are freed first (e.g. a
        row whose start reached this replica after its request had already ended)."""
        self.sessions._expire()
        return {"sessions": len(self.sessions), "cached_tokens": self.sessions.cached_tokens(),
                "expired": self.sessions.expired, "evicted": self.sessions.evicted,
                "rss_mb": rss_mb(), "peak_gpu_mb": _json_mb(peak_gpu_mb()),
                "pid": os.getpid()}

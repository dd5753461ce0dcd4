"""The batching clock of a model replica: the steps of concurrent requests run together.

Each request's coroutine submits its next step (``await batcher.submit(step, source)``)
and gets that step's result; :class:`StepBatcher` runs ``run(steps)`` on ONE batch at a
time. A batch closes as soon as every expected source has a step queued
(``expected()``: how many sources are live, e.g. the requests decoding on this replica),
or ``max_batch`` steps are queued, or ``max_wait_s`` after it opened. So one client
never waits, clients in lockstep batch fully, and a straggler delays the others by at
most ``max_wait_s`` (the bounded wait of Ray Serve's ``@serve.batch``, which alone would
make a single client pay the full wait every round).

A step whose work takes several batches (a long prompt prefilled a chunk per batch)
answers :data:`AGAIN` from ``run``: it joins the next batch, first in line, and its
caller keeps waiting.

Nothing here imports Ray: the deployments own the batcher and their model work.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from serve_apps.errors import as_failure, downstream_cancel

#: ``run``'s result for a step that is not done yet: it runs again in the next batch
AGAIN = object()


class StepBatcher:
    """Collects steps into batches; see the module docstring."""

    def __init__(self, run: Callable[[list[Any]], Awaitable[list[Any]]],
                 expected: Callable[[], int], max_batch: int = 64,
                 max_wait_s: float = 0.005,
                 on_batch: Callable[[int, float], None] | None = None,
                 dropped: Callable[[Any], None] | None = None) -> None:
        """``run(steps)`` returns one result per step (an exception instance fails only
        its step; :data:`AGAIN`: run it again); ``on_batch(size, wait_s)`` is told about
        every batch; ``dropped(step)`` about a step whose caller stopped waiting before
        it ran (again)."""
        self.run, self.expected, self.dropped = run, expected, dropped
        self.max_batch, self.max_wait_s = max_batch, max_wait_s
        self.on_batch = on_batch
        self._queue: list[tuple[Any, str, asyncio.Future]] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.batches = 0
        self.steps = 0

    async def submit(self, step: Any, source: str) -> Any:
        """Queue ``step`` of ``source``; its result once its batch ran."""
        if self._wake is None:
            self._wake = asyncio.Event()
        fut = asyncio.get_running_loop().create_future()
        self._queue.append((step, source, fut))
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop())
        return await fut

    def _ready(self) -> bool:
        sources = {src for _, src, _ in self._queue}
        return len(self._queue) >= self.max_batch or len(sources) >= self.expected()

    async def _loop(self) -> None:
        while self._queue:
            t_open = time.perf_counter()
            deadline = t_open + self.max_wait_s
            while not self._ready():
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), left)
                except TimeoutError:
                    break
            batch, self._queue = self._queue[:self.max_batch], self._queue[self.max_batch:]
            live = [(s, src, f) for s, src, f in batch if not f.done()]  # cancelled: out
            if self.dropped is not None:
                for s, _, f in batch:
                    if f.done():
                        self.dropped(s)
            if not live:
                continue
            self.batches += 1
            self.steps += len(live)
            try:
                if self.on_batch is not None:
                    self.on_batch(len(live), time.perf_counter() - t_open)
                results = await self.run([s for s, _, _ in live])
                if len(results) != len(live):
                    raise RuntimeError(f"batch: {len(results)} results for {len(live)} steps")
            except Exception as exc:  # the whole batch failed: every step hears why
                results = [exc] * len(live)
            except asyncio.CancelledError as exc:  # a replica call of the batch, not us
                if not downstream_cancel(exc):
                    raise
                results = [as_failure(exc, "batch")] * len(live)
            again = []
            for (step, src, fut), res in zip(live, results, strict=True):
                if fut.done():
                    continue
                if res is AGAIN:
                    again.append((step, src, fut))
                elif isinstance(res, BaseException):
                    fut.set_exception(as_failure(res, "step"))
                else:
                    fut.set_result(res)
            self._queue[:0] = again  # first in line for the next batch

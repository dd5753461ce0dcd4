"""Buffer-and-retry delivery of metrics to MLflow: a tracking outage never stalls or
crashes training, and nothing is lost silently.

Ray Train's rank 0 hands each report's metrics to a :class:`MetricBuffer` (in memory,
bounded, in order, every point with its run, step and the timestamp it was measured at).
A background thread sends them with ``log_batch`` (at most :data:`BATCH_POINTS` a call);
when the server does not answer, the points stay queued and the thread retries with a
backoff (0.5 s doubling to :data:`RETRY_CAP_S`), so the training loop never waits on the
network. Retried points keep their timestamps, so a batch that did reach the server
before the connection broke is not stored twice (MLflow's SQL stores drop exact
duplicates). While points are pending during an outage, rank 0 also writes them to the
spool file :data:`SPOOL_NAME` in the run folder at each report, so a restarted worker or
a ``train.resume=true`` rerun delivers them (to the run they were measured in).

At the end of training the buffer gets ``SPECLAB_TRACKING_FLUSH_TIMEOUT_S`` seconds to
empty; what is still undelivered stays in the spool and the driver fails the job with
:class:`speclab.tracking.TrackingUnavailable` (see :func:`speclab.pipelines.fit.fit`).

Environment:

``SPECLAB_TRACKING_FLUSH_TIMEOUT_S`` (default 120)
    How long tracking waits for an unreachable server to come back: the final flush of
    a training job's buffered metrics, and each driver-side MLflow call of
    :class:`speclab.tracking.MlflowTracker`.
``SPECLAB_TRACKING_BUFFER_POINTS`` (default 100000)
    At most this many metric points wait in memory; beyond that new points are dropped,
    counted, reported, and the job fails at the end (they are not silently lost).

In the process that runs a buffer (a training worker), MLflow's own HTTP retries are
turned off and each request gets :data:`REQUEST_TIMEOUT_S` (``MLFLOW_HTTP_REQUEST_MAX_RETRIES=0``,
``MLFLOW_HTTP_REQUEST_TIMEOUT``): the buffer does the retrying, and one call never blocks
for MLflow's default of minutes.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FLUSH_TIMEOUT_ENV = "SPECLAB_TRACKING_FLUSH_TIMEOUT_S"
DEFAULT_FLUSH_TIMEOUT_S = 120.0
BUFFER_POINTS_ENV = "SPECLAB_TRACKING_BUFFER_POINTS"
DEFAULT_BUFFER_POINTS = 100_000
#: seconds one request of a buffer may take (MLflow's default is 120 s, with retries)
REQUEST_TIMEOUT_S = 15
#: MLflow accepts at most 1000 metrics in one ``log_batch``
BATCH_POINTS = 1000
#: the longest pause between two delivery attempts during an outage
RETRY_CAP_S = 5.0
#: pending points of a run folder, written while the server is unreachable
SPOOL_NAME = "tracking_spool.json"


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"${name}: expected a number of seconds, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"${name}: must be >= 0, got {raw!r}")
    return value


def flush_timeout_s() -> float:
    """``$SPECLAB_TRACKING_FLUSH_TIMEOUT_S`` (default 120): how long to wait for the
    tracking server to come back before giving up."""
    return _env_float(FLUSH_TIMEOUT_ENV, DEFAULT_FLUSH_TIMEOUT_S)


def buffer_points() -> int:
    """``$SPECLAB_TRACKING_BUFFER_POINTS`` (default 100000): the buffer's capacity."""
    return max(1, int(_env_float(BUFFER_POINTS_ENV, DEFAULT_BUFFER_POINTS)))


def is_transient(exc: BaseException) -> bool:
    """True if ``exc`` means "the tracking server did not answer (properly)": a refused or
    broken connection, a timeout, HTTP 5xx / 408 / 429, a locked SQLite store. False for
    answers that retrying cannot change (bad value, unknown run, HTTP 4xx)."""
    import requests

    if isinstance(exc, requests.RequestException | ConnectionError | TimeoutError):
        return True
    text = str(exc)
    if "database is locked" in text:
        return True
    try:
        from mlflow.exceptions import MlflowException, RestException
    except ImportError:  # pragma: no cover - mlflow is a dependency
        return False
    if isinstance(exc, MlflowException):
        if not isinstance(exc, RestException) and text.startswith("API request to") and (
                "failed with exception" in text or "failed with timeout" in text):
            return True  # the transport failed (MLflow wraps requests' errors like this)
        if isinstance(exc.__context__, requests.RequestException | ConnectionError):
            return True
        status = exc.get_http_status_code()
        return status >= 500 or status in (408, 429)
    return False


_CAUSES = ("Connection refused", "Connection reset", "Connection aborted", "Read timed out",
           "timed out", "Remote end closed connection", "Name or service not known",
           "No route to host", "database is locked")


def short_error(exc: BaseException, limit: int = 300) -> str:
    """``Type: message`` of ``exc`` on one line, cut to ``limit`` characters, led by the
    root cause when it is a known network one (``Connection refused: ...``)."""
    text = " ".join(str(exc).split())
    out = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    cause = next((c for c in _CAUSES if c in text), None)
    if cause:
        out = f"{cause}: {out}"
    return out if len(out) <= limit else out[: limit - 3] + "..."


@dataclass(frozen=True)
class MetricPoint:
    """One metric value as measured: run, key, value, timestamp (ms) and step."""

    run_id: str
    key: str
    value: float
    timestamp: int
    step: int

    def to_json(self) -> list:
        """A compact JSON form (a list) for the spool file."""
        return [self.run_id, self.key, self.value, self.timestamp, self.step]

    @classmethod
    def from_json(cls, item: list) -> MetricPoint:
        """Inverse of :meth:`to_json`."""
        run_id, key, value, timestamp, step = item
        return cls(str(run_id), str(key), float(value), int(timestamp), int(step))


def load_spool(path: Path) -> tuple[list[MetricPoint], dict[str, Any]]:
    """The points in spool file ``path`` and its header (uri, counts); ``([], {})`` when
    there is none."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return [], {}
    points = [MetricPoint.from_json(item) for item in data.get("points", [])]
    return points, {k: v for k, v in data.items() if k != "points"}


class MetricBuffer:
    """Bounded, ordered queue of metric points, delivered by a background thread.

    ``add`` never blocks on the network; ``close(timeout)`` waits up to ``timeout`` s for
    the queue to empty and returns what is left. ``client`` (default: an
    ``MlflowClient(uri)``) needs ``log_batch(run_id, metrics=[Metric, ...])``.
    """

    def __init__(self, uri: str, max_points: int | None = None, client: Any = None,
                 log: Callable[[str], None] | None = None) -> None:
        self.uri = uri
        self.max_points = max_points or buffer_points()
        self._client = client
        self._log = log or (lambda msg: print(msg, flush=True))
        self._points: deque[MetricPoint] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._closing = False
        self._next_try = 0.0
        self._backoff = 0.5
        self._outage_since: float | None = None  # monotonic time of the first failure
        self._outage_points = 0  # points queued when the outage was noticed or added during it
        self.delivered = 0
        self.dropped = 0
        self.rejected = 0
        self.outages = 0
        self.last_error: str | None = None

    # -- producer side ----------------------------------------------------------------
    def add(self, run_id: str, metrics: dict[str, Any], step: int,
            timestamp_ms: int | None = None) -> None:
        """Queue ``metrics`` (numbers only, bools skipped) of ``run_id`` at ``step``."""
        now = int(time.time() * 1000) if timestamp_ms is None else int(timestamp_ms)
        self.extend(MetricPoint(run_id, str(k), float(v), now, int(step))
                    for k, v in metrics.items()
                    if isinstance(v, int | float) and not isinstance(v, bool))

    def extend(self, points: Iterable[MetricPoint]) -> None:
        """Queue ``points`` in order (e.g. what a spool file kept)."""
        dropped_now = 0
        with self._cond:
            for point in points:
                if len(self._points) >= self.max_points:
                    dropped_now += 1
                    continue
                self._points.append(point)
                if self._outage_since is not None:
                    self._outage_points += 1
            self.dropped += dropped_now
            self._cond.notify_all()
        if dropped_now and self.dropped == dropped_now:
            self._log(f"[tracking] ERROR: metric buffer full ({self.max_points} points, "
                      f"${BUFFER_POINTS_ENV}); dropping new points (MLflow server "
                      f"{self.uri} unreachable or too slow); the job will fail at the end")

    @property
    def pending(self) -> int:
        """Points not delivered yet."""
        with self._cond:
            return len(self._points)

    @property
    def failing(self) -> bool:
        """True while the last delivery attempt failed (an outage is in progress)."""
        with self._cond:
            return self._outage_since is not None

    # -- delivery -----------------------------------------------------------------
    def start(self) -> MetricBuffer:
        """Start the delivery thread (once); returns ``self``."""
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="speclab-metrics",
                                                daemon=True)
                self._thread.start()
        return self

    def _client_or_default(self):
        if self._client is None:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(self.uri)
        return self._client

    def _send(self, batch: list[MetricPoint]) -> None:
        from mlflow.entities import Metric

        self._client_or_default().log_batch(batch[0].run_id, metrics=[
            Metric(p.key, p.value, p.timestamp, p.step) for p in batch])

    def _take_batch(self) -> list[MetricPoint]:
        """The first points of the queue that share a run (not removed yet)."""
        batch: list[MetricPoint] = []
        for point in self._points:
            if len(batch) >= BATCH_POINTS or (batch and point.run_id != batch[0].run_id):
                break
            batch.append(point)
        return batch

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and (
                        not self._points or time.monotonic() < self._next_try):
                    wait = None if not self._points else self._next_try - time.monotonic()
                    self._cond.wait(timeout=wait)
                if self._stop:
                    return
                batch = self._take_batch()
            try:
                self._send(batch)
                error = None
            except Exception as exc:  # classified below; the thread must not die
                error = exc
            with self._cond:
                self._settle(batch, error)
                self._cond.notify_all()

    def _settle(self, batch: list[MetricPoint], error: Exception | None) -> None:
        """Account for one attempt (called with the lock held)."""
        now = time.monotonic()
        if error is None or not is_transient(error):
            for _ in batch:
                self._points.popleft()
            if error is None:
                self.delivered += len(batch)
            else:
                self.rejected += len(batch)
                self.last_error = short_error(error)
                self._log(f"[tracking] ERROR: MLflow server {self.uri} rejected {len(batch)} "
                          f"metric points of run {batch[0].run_id}: {self.last_error}")
            if error is None and self._outage_since is not None:
                self._log(f"[tracking] MLflow server {self.uri} answers again after "
                          f"{now - self._outage_since:.1f} s; delivering "
                          f"{self._outage_points} buffered metric points")
                self._outage_since = None
            self._backoff, self._next_try = 0.5, 0.0
            return
        self.last_error = short_error(error)
        if self._outage_since is None:
            self._outage_since = now
            self.outages += 1
            self._outage_points = len(self._points)
            self._log(f"[tracking] MLflow server {self.uri} unreachable "
                      f"({self.last_error[:160]}); buffering metrics and retrying "
                      f"({len(self._points)} points pending)")
        cap = 1.0 if self._closing else RETRY_CAP_S
        self._next_try = now + min(self._backoff, cap)
        self._backoff = min(self._backoff * 2, cap)

    def close(self, timeout: float) -> int:
        """Try to deliver everything for up to ``timeout`` s, stop the thread and return
        the number of points still undelivered (they stay queued for :meth:`save`)."""
        self.start()
        deadline = time.monotonic() + timeout
        with self._cond:
            self._closing = True
            self._backoff = min(self._backoff, 1.0)
            self._next_try = min(self._next_try, time.monotonic())  # try at once
            self._cond.notify_all()
            while self._points and not self._stop:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(timeout=left)
            self._stop = True
            self._cond.notify_all()
        thread = self._thread
        if thread is not None:  # an attempt in flight ends within the request timeout
            thread.join(REQUEST_TIMEOUT_S + 5)
        return self.pending

    # -- spool ------------------------------------------------------------------------
    def save(self, path: Path, force: bool = False) -> None:
        """Write the pending points to spool file ``path`` (atomically) during an outage,
        when the file already exists, or with ``force``; remove it once nothing is
        pending. Cheap no-op while the server answers."""
        path = Path(path)
        with self._cond:
            points = list(self._points)
            counts = {"dropped": self.dropped, "rejected": self.rejected}
            outage = self._outage_since is not None
        if not points and not any(counts.values()):
            path.unlink(missing_ok=True)
            return
        if not (force or outage or path.exists() or any(counts.values())):
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"uri": self.uri, **counts, "last_error": self.last_error,
                                   "points": [p.to_json() for p in points]}))
        os.replace(tmp, path)


def quiet_mlflow_http(timeout_s: int = REQUEST_TIMEOUT_S) -> None:
    """No MLflow-level HTTP retries and a ``timeout_s`` request timeout in this process
    (for processes whose MLflow calls all go through a :class:`MetricBuffer`)."""
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(int(timeout_s))


def deliver_spool(path: Path, uri: str, timeout: float,
                  log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Try for up to ``timeout`` s to deliver what spool file ``path`` holds; rewrite or
    remove the file accordingly. Returns ``{"undelivered", "dropped", "rejected",
    "delivered", "last_error"}`` (all zero/None when there was no spool)."""
    points, header = load_spool(path)
    out = {"undelivered": 0, "dropped": int(header.get("dropped", 0)),
           "rejected": int(header.get("rejected", 0)), "delivered": 0,
           "last_error": header.get("last_error")}
    if not points:
        return out
    buf = MetricBuffer(uri, max_points=max(len(points), 1), log=log)
    buf.extend(points)
    out["undelivered"] = buf.close(timeout)
    out["delivered"] = buf.delivered
    out["rejected"] += buf.rejected
    out["last_error"] = buf.last_error or out["last_error"]
    buf.dropped, buf.rejected = out["dropped"], out["rejected"]  # keep the counts on file
    buf.save(path, force=True)
    return out

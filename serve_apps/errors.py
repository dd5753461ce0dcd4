"""Per-request errors between the Serve deployments.

A batched target call answers each request of the batch on its own: a request the
replica no longer holds or whose input is bad gets an error entry
``{"error": {"kind": "gone" | "invalid" | "failed", "message"}}`` (built by
:func:`serve_apps.target.row_error`) while the others get their verdicts. The replica
that drives the request turns an entry back into an exception with
:func:`request_error`; the ingress maps it to an HTTP status (``ValueError``: 400 naming
the field, anything else: 503).

A replica call can also end in ``asyncio.CancelledError`` without anyone cancelling the
caller: Ray Serve turns the ``TaskCancelledError`` of a task on a replica that died or
was stopped into one. :func:`downstream_cancel` tells that apart from the caller's own
cancellation, and :func:`as_failure` makes it the replica failure it is (a 503), so it
neither escapes as a cancellation (an HTTP 500 "No response returned") nor stops a
batching loop.
"""

from __future__ import annotations

import asyncio

from serve_apps.sessions import SessionGone


def request_error(rid: str, error: dict) -> Exception:
    """An error entry of request ``rid`` as the exception the ingress maps to 400 / 503:
    ``invalid`` -> ``ValueError`` (the message names the field), ``failed`` ->
    ``RuntimeError``, ``gone`` -> :class:`~serve_apps.sessions.SessionGone`."""
    if error["kind"] == "invalid":
        return ValueError(error["message"])
    if error["kind"] == "failed":
        return RuntimeError(f"request {rid}: {error['message']}")
    return SessionGone(f"request {rid}: {error['message']}")


def downstream_cancel(exc: BaseException) -> bool:
    """Whether ``exc`` is a CancelledError that came from a replica call while the running
    task itself was not being cancelled (a client that went away, a deadline: those
    cancel the running task, and stay cancellations)."""
    if not isinstance(exc, asyncio.CancelledError):
        return False
    task = asyncio.current_task()
    return task is None or task.cancelling() == 0


def as_failure(exc: BaseException, what: str) -> BaseException:
    """``exc``, or for a CancelledError that a replica call returned or raised (see
    :func:`downstream_cancel`; an entry of ``gather(..., return_exceptions=True)`` is one
    whenever it is a CancelledError) a RuntimeError naming ``what``."""
    if isinstance(exc, asyncio.CancelledError):
        return RuntimeError(f"{what}: the replica's task was cancelled (the replica died "
                            "or was stopped)")
    return exc

"""Per-request errors between the Serve deployments.

A batched target call answers each request of the batch on its own: a request the
replica no longer holds or whose input is bad gets an error entry
``{"error": {"kind": "gone" | "invalid" | "failed", "message"}}`` (built by
:func:`serve_apps.target.row_error`) while the others get their verdicts. The replica
that drives the request turns an entry back into an exception with
:func:`request_error`; the ingress maps it to an HTTP status (``ValueError``: 400 naming
the field, anything else: 503).
"""

from __future__ import annotations

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

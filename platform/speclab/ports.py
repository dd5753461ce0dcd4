"""Checks on the local TCP ports a command is about to serve on, before it starts anything
(so a busy port is one line naming the field, not a traceback from deep inside Ray or an
MLflow server that exits behind a printed link)."""

from __future__ import annotations

import socket


def check_port_free(field: str, host: str, port: int) -> None:
    """ValueError naming ``field`` when nothing can listen on ``host:port`` (in use, or
    not an address of this machine)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAIT
        try:                                                       # is not "in use"
            s.bind((host, int(port)))
        except OSError as exc:
            why = "already in use" if exc.errno in (98, 48) else exc.strerror or str(exc)
            raise ValueError(f"{field}: cannot listen on {host}:{port} ({why})") from None


def answers(host: str, port: int, timeout_s: float = 5.0) -> bool:
    """Whether something accepts a TCP connection on ``host:port`` within ``timeout_s``."""
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False

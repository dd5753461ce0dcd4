"""``serve.metrics_port`` on the loopback: a forwarder in front of Ray's exporter.

Ray's Prometheus exporter (the Serve app's ``ray_*`` metrics, :mod:`serve_apps.metrics`)
listens on every interface of its node: Ray binds it to the loopback only when the
node's own address is a loopback one, and ``ray.init`` / ``ray start`` replace
``127.0.0.1`` by the machine's address. So ``speclab serve`` leaves Ray its own
exporter port (one of Ray's ports, see the README) and serves ``serve.metrics_port`` on
``serve.host`` itself: each scrape of ``/metrics`` there is one GET to Ray's exporter
through the loopback, answered with its text.
"""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

#: seconds one scrape waits for Ray's exporter
UPSTREAM_TIMEOUT_S = 10.0


def ray_exporter_port() -> int:
    """The Prometheus port of the Ray node this process joined (``ray.init`` done)."""
    import ray

    me = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == me:
            return int(node["MetricsExportPort"])
    raise RuntimeError("serve.metrics_port: this process's Ray node is not in ray.nodes()")


class MetricsForwarder:
    """``GET /metrics`` on ``host:port`` answered from ``127.0.0.1:upstream/metrics``
    (a thread; :meth:`close` stops it). Other paths: 404; Ray's exporter down: 502."""

    def __init__(self, host: str, port: int, upstream: int) -> None:
        url = f"http://127.0.0.1:{upstream}/metrics"

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?", 1)[0] != "/metrics":
                    return self._reply(404, b"not found: GET /metrics\n", "text/plain")
                try:
                    with urllib.request.urlopen(url, timeout=UPSTREAM_TIMEOUT_S) as r:
                        self._reply(200, r.read(), r.headers.get("Content-Type",
                                                                 "text/plain"))
                except (urllib.error.URLError, OSError) as exc:
                    self._reply(502, f"Ray's metrics exporter ({url}): {exc}\n".encode(),
                                "text/plain")

            def _reply(self, status: int, body: bytes, ctype: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # scrapes are not news
                del args

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True,
                                        name="metrics-forwarder")
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

"""`--http ADDR:PORT`: a run's Prometheus metrics and a health endpoint for probes.

`bamboo train --http` and `bamboo coordinator --http` serve, on a background thread of the
coordinator process:

    GET /healthz   200 and a small JSON body ({"status": "training", "step": 12, ...}), or
                   503 when the owner reports itself unhealthy
    GET /metrics   the run's metrics in the Prometheus text format

`RunMetrics` owns the metrics in a private registry (never prometheus_client's global one,
so two runs in one process, or a test, never share series); the coordinator updates it once
per iteration of its loop from the state its parts already keep. `HealthServer` binds at
construction (an OSError when it cannot) and answers each request on its own daemon
thread, with a socket timeout, so a client that connects and stalls delays nobody else.
"""
from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from bamboo.util import strict_json

__all__ = ["RunMetrics", "HealthServer", "HttpServeError", "HealthCheck", "PAUSE_BUCKETS"]

PAUSE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
"""Failover pauses, 10 ms (a failover inside a fast step) to a minute (a slow one)."""

_KNOWN_HANDLING = ("failover", "drain", "peer_restore", "checkpoint_restore", "standby")
"""`handled_as` values whose series exist from the start (at 0), so rate() sees the first."""

HealthCheck = Callable[[], tuple[bool, dict[str, Any]]]
"""The owner's health: (healthy, a small JSON-able body)."""


class HttpServeError(RuntimeError):
    """`--http ADDR:PORT` could not be served; str() is the one line for the user."""


class RunMetrics:
    """The metrics of one run, in a registry of its own.

    Every update takes `lock`; a scrape takes it too, so a caller that updates several
    metrics under `with metrics.lock:` is scraped as one consistent snapshot (a step and
    the loss of that same step)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.lock = threading.RLock()
        r = self.registry
        self.step = Gauge("bamboo_step", "Steps committed so far (the next step to run)",
                          registry=r)
        self.loss = Gauge("bamboo_loss", "Loss of the last committed step", registry=r)
        self.metric = Gauge("bamboo_metric", "The job's metrics (--metric) of the last "
                            "committed step, by name", ["name"], registry=r)
        self.samples_per_second = Gauge("bamboo_samples_per_second",
                                        "Throughput of the last recorded step (samples/s)",
                                        registry=r)
        self.live_nodes = Gauge("bamboo_live_nodes", "Nodes whose process is alive",
                                registry=r)
        self.stages_without_redundancy = Gauge(
            "bamboo_stages_without_redundancy",
            "Stages (of every pipeline) with no live replica: a loss there cannot fail over",
            registry=r)
        self.worker_rss = Gauge("bamboo_worker_rss_bytes_max",
                                "Largest resident memory of the workers at the last recorded step",
                                registry=r)
        self.replica_host_bytes = Gauge(
            "bamboo_replica_host_bytes_max",
            "Largest replica a node kept in host memory so far (summary.json's replica_host_bytes)",
            registry=r)
        self.preemptions = Counter("bamboo_preemptions_total",
                                   "Nodes lost, by how the run covered them", ["handled_as"],
                                   registry=r)
        self.reconfigurations = Counter("bamboo_reconfigurations_total",
                                        "Generation changes (new plans) so far", registry=r)
        self.failover_pause = Histogram("bamboo_failover_pause_seconds",
                                        "Extra wall time of the step a failover happened in",
                                        buckets=PAUSE_BUCKETS, registry=r)
        for kind in _KNOWN_HANDLING:
            self.preemptions.labels(handled_as=kind)

    # -- updates ----------------------------------------------------------------------------

    def set_step(self, step: int) -> None:
        with self.lock:
            self.step.set(step)

    def set_loss(self, loss: float) -> None:
        with self.lock:
            self.loss.set(loss)

    def set_metrics(self, values: dict[str, float]) -> None:
        """The job's metrics (`--metric`) of the last committed step."""
        with self.lock:
            for name, value in values.items():
                self.metric.labels(name=name).set(value)

    def set_samples_per_second(self, value: float) -> None:
        with self.lock:
            self.samples_per_second.set(value)

    def set_live_nodes(self, count: int) -> None:
        with self.lock:
            self.live_nodes.set(count)

    def set_worker_rss(self, value: int) -> None:
        with self.lock:
            self.worker_rss.set(value)

    def set_replica_host_bytes(self, value: int) -> None:
        with self.lock:
            self.replica_host_bytes.set(value)

    def set_stages_without_redundancy(self, count: int) -> None:
        with self.lock:
            self.stages_without_redundancy.set(count)

    def add_preemptions(self, handled_as: str, count: int = 1) -> None:
        """`count` more nodes lost and covered as `handled_as` (any string the caller uses)."""
        if count > 0:
            with self.lock:
                self.preemptions.labels(handled_as=str(handled_as)).inc(count)

    def add_reconfigurations(self, count: int = 1) -> None:
        if count > 0:
            with self.lock:
                self.reconfigurations.inc(count)

    def observe_failover_pause(self, seconds: float) -> None:
        with self.lock:
            self.failover_pause.observe(max(0.0, seconds))

    # -- reading ----------------------------------------------------------------------------

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format (one consistent snapshot)."""
        with self.lock:
            return generate_latest(self.registry)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = 5.0  # a client that connects and sends nothing holds only its own thread
    protocol_version = "HTTP/1.0"  # one request per connection: no idle keep-alive threads

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        if path == "/healthz":
            self._healthz()
        elif path == "/metrics":
            body = self.server.metrics.exposition() if self.server.metrics else b""
            self._send(200, CONTENT_TYPE_LATEST, body)
        else:
            self._send(404, "text/plain; charset=utf-8", b"not found: try /healthz or /metrics\n")

    def _healthz(self) -> None:
        try:
            healthy, body = self.server.health()
        except Exception as e:  # noqa: BLE001 (the owner's check failed: that is unhealthy, not a crash)
            healthy, body = False, {"status": "error", "error": f"{type(e).__name__}: {e}"}
        self._send(200 if healthy else 503, "application/json",
                   (strict_json.dumps(body, default=str) + "\n").encode())

    def _send(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # no request log on stderr: it would tear through the progress panel


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    metrics: RunMetrics | None
    health: HealthCheck

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hung up or timed out: nothing to print


def _default_health() -> tuple[bool, dict[str, Any]]:
    return True, {"status": "ok"}


class HealthServer:
    """`/healthz` and `/metrics` on `host:port` (port 0: any free one; see `address`)."""

    def __init__(self, host: str, port: int, *, metrics: RunMetrics | None = None,
                 health: HealthCheck | None = None) -> None:
        host = host.strip("[]")
        server_class = _Server
        if ":" in host:  # an IPv6 address
            server_class = type("_Server6", (_Server,), {"address_family": socket.AF_INET6})
        self._server = server_class((host, port), _Handler)  # OSError when it cannot bind
        self._server.metrics = metrics
        self._server.health = health or _default_health
        bound = self._server.server_address
        self.address: tuple[str, int] = (str(bound[0]), int(bound[1]))
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.2},
                                        name=f"bamboo-http-{self.address[1]}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and release the port (requests in flight end on their own)."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=5)
        self._server.server_close()

    def __enter__(self) -> HealthServer:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

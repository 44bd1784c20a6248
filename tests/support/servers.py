"""Servers the fleet talks to, on loopback: a real etcd, and a cloud metadata endpoint that
answers as AWS IMDSv2, GCE metadata or Azure IMDS do (preemption notices)."""
from __future__ import annotations

import contextlib
import json
import secrets
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest

AWS_TIME = "2026-05-01T12:02:00Z"
AZURE_NOT_BEFORE = "Fri, 01 May 2026 12:00:30 GMT"
VM = "bamboo-vm-3"


def one_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def etcd_server(data: Path) -> Iterator[str]:
    """A real etcd (Debian's etcd-server) on a free loopback port, its data and log in
    `data`: its client URL. FAILS (never skips) where the binary is missing."""
    binary = shutil.which("etcd") or ("/usr/bin/etcd" if Path("/usr/bin/etcd").exists() else None)
    if binary is None:
        pytest.fail("etcd is not installed: run `apt-get install -y etcd-server` "
                    "(make setup / .ci/run do this) to test the etcd membership backend")
    client, peer = one_free_port(), one_free_port()
    url = f"http://127.0.0.1:{client}"
    with open(data / "etcd.log", "wb") as log:
        proc = subprocess.Popen(
            [binary, "--name", "t", "--data-dir", str(data / "d"),
             "--listen-client-urls", url, "--advertise-client-urls", url,
             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"t=http://127.0.0.1:{peer}",
             # short raft timers: etcd's smallest lease TTL is 1.5 x the election timeout
             "--heartbeat-interval", "50", "--election-timeout", "250"],
            stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(url, proc, data / "etcd.log")
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as resp:
                if b"true" in resp.read():
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"etcd did not start: {log.read_text()[-800:]}")
        time.sleep(0.1)


class FakeMetadata(BaseHTTPRequestHandler):
    """Answers as AWS IMDSv2, GCE metadata or Azure IMDS, by `server.cloud`."""

    server: MetadataServer

    def log_message(self, *args: object) -> None:  # keep pytest output clean
        pass

    def _send(self, status: int, body: bytes | str, ctype: str = "text/plain") -> None:
        data = body.encode() if isinstance(body, str) else body
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_PUT(self) -> None:
        self.server.requests.append(("PUT", self.path))
        ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
        if self.server.cloud != "aws" or self.path != "/latest/api/token":
            return self._send(404, "not found")
        if not ttl or not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
            return self._send(400, "bad ttl")
        token = secrets.token_urlsafe(16)
        self.server.tokens.add(token)
        self._send(200, token)

    def do_GET(self) -> None:
        self.server.requests.append(("GET", self.path))
        url = urlparse(self.path)
        handler = {"aws": self._aws, "gcp": self._gcp, "azure": self._azure}[self.server.cloud]
        handler(url.path, parse_qs(url.query))

    def _aws(self, path: str, query: dict) -> None:
        if self.headers.get("X-aws-ec2-metadata-token") not in self.server.tokens:
            return self._send(401, "")  # IMDSv2 only: no or stale token
        if path != "/latest/meta-data/spot/instance-action" or not self.server.notice:
            return self._send(404, "Not Found")
        self._send(200, json.dumps({"action": "terminate", "time": AWS_TIME}), "application/json")

    def _gcp(self, path: str, query: dict) -> None:
        if self.headers.get("Metadata-Flavor") != "Google":
            return self._send(403, "Missing Metadata-Flavor:Google header.")
        if path != "/computeMetadata/v1/instance/preempted":
            return self._send(404, "not found")
        self._send(200, "TRUE" if self.server.notice else "FALSE")

    def _azure(self, path: str, query: dict) -> None:
        if self.headers.get("Metadata") != "true":
            return self._send(400, json.dumps({"error": "Bad request. Required metadata header not specified"}))
        if path == "/metadata/instance/compute/name" and query.get("format") == ["text"]:
            return self._send(200, VM)
        if path != "/metadata/scheduledevents" or query.get("api-version") != ["2020-07-01"]:
            return self._send(404, "not found")
        other = {"EventId": "A1", "EventType": "Preempt", "ResourceType": "VirtualMachine",
                 "Resources": ["some-other-vm"], "EventStatus": "Scheduled",
                 "NotBefore": AZURE_NOT_BEFORE, "Description": "", "EventSource": "Platform",
                 "DurationInSeconds": -1}
        events = [other]
        if self.server.notice:
            events.append(dict(other, EventId="B2", Resources=[VM]))
        self._send(200, json.dumps({"DocumentIncarnation": 1 + self.server.notice,
                                    "Events": events}), "application/json")


class MetadataServer(ThreadingHTTPServer):
    """A cloud's metadata endpoint on a free loopback port; set `notice` to announce the
    preemption."""
    daemon_threads = True

    def __init__(self, cloud: str) -> None:
        super().__init__(("127.0.0.1", 0), FakeMetadata)
        self.cloud = cloud
        self.notice = False
        self.tokens: set[str] = set()
        self.requests: list[tuple[str, str]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def start(self) -> MetadataServer:
        """Serving, on a daemon thread."""
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()

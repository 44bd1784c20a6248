"""Preemption-notice sources against local HTTP servers that answer as the real endpoints do.

One shared suite runs over AWS (IMDSv2), GCP and Azure: first no notice, then a notice;
plus SIGTERM, the watcher's once-per-notice callback, and its survival of failing sources.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest

from bamboo.fleet.notices import (AwsSpotNotice, AzurePreemptNotice, GcpPreemptedNotice,
                                    Notice, NoticeError, NoticeWatcher, SigtermNotice)

AWS_TIME = "2026-05-01T12:02:00Z"
AZURE_NOT_BEFORE = "Fri, 01 May 2026 12:00:30 GMT"
VM = "bamboo-vm-3"


class FakeMetadata(BaseHTTPRequestHandler):
    """Answers as AWS IMDSv2, GCE metadata or Azure IMDS, by `server.cloud`."""

    server: "MetadataServer"

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


@pytest.fixture
def metadata(request):
    server = MetadataServer(request.param)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def make(cloud: str, url: str):
    return {"aws": AwsSpotNotice, "gcp": GcpPreemptedNotice, "azure": AzurePreemptNotice}[cloud](url)


EXPECTED = {  # cloud -> (action, deadline)
    "aws": ("terminate", 1777636920.0),
    "gcp": ("preempt", None),
    "azure": ("preempt", 1777636830.0),
}


@pytest.mark.timeout(20)
@pytest.mark.parametrize("metadata", ["aws", "gcp", "azure"], indirect=True)
def test_no_notice_then_notice(metadata):
    source = make(metadata.cloud, metadata.url)
    assert source.poll() is None
    assert source.poll() is None
    metadata.notice = True
    notice = source.poll()
    assert isinstance(notice, Notice)
    assert notice.source == metadata.cloud
    assert (notice.action, notice.deadline) == EXPECTED[metadata.cloud]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("metadata", ["aws", "gcp", "azure"], indirect=True)
def test_watcher_calls_back_once_per_notice(metadata):
    got: list[Notice] = []
    with NoticeWatcher([make(metadata.cloud, metadata.url)], got.append, interval_s=0.05):
        time.sleep(0.3)
        assert got == []
        metadata.notice = True
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # several more polls see the same notice
    assert len(got) == 1, got
    assert got[0].source == metadata.cloud


@pytest.mark.timeout(20)
@pytest.mark.parametrize("metadata", ["aws"], indirect=True)
def test_aws_uses_imdsv2_token_and_renews_it(metadata):
    source = AwsSpotNotice(metadata.url)
    assert source.poll() is None and source.poll() is None
    puts = [r for r in metadata.requests if r[0] == "PUT"]
    assert len(puts) == 1, "the token is reused while valid"
    metadata.tokens.clear()  # IMDS forgot every token: 401, then one new token
    metadata.notice = True
    assert source.poll().action == "terminate"
    assert len([r for r in metadata.requests if r[0] == "PUT"]) == 2
    short = AwsSpotNotice(metadata.url, token_ttl_s=1)
    short.poll()
    time.sleep(1.0)
    short.poll()  # renewed before the TTL ran out
    assert len([r for r in metadata.requests if r[0] == "PUT"]) == 4


@pytest.mark.timeout(20)
@pytest.mark.parametrize("metadata", ["gcp"], indirect=True)
def test_wrong_endpoint_is_a_notice_error(metadata):
    source = AwsSpotNotice(metadata.url)  # GCP server answers 404 to the token PUT
    with pytest.raises(NoticeError, match="token request"):
        source.poll()


@pytest.mark.timeout(20)
def test_unreachable_endpoint_is_one_line_error():
    with pytest.raises(NoticeError) as info:
        GcpPreemptedNotice("http://127.0.0.1:1", timeout_s=0.5).poll()
    assert "\n" not in str(info.value) and "127.0.0.1:1" in str(info.value)


@pytest.mark.timeout(20)
def test_watcher_survives_failing_source_and_logs_once(caplog):
    got: list[Notice] = []
    broken = GcpPreemptedNotice("http://127.0.0.1:1", timeout_s=0.2)
    sig = SigtermNotice(grace_s=30)
    try:
        with caplog.at_level(logging.WARNING, logger="bamboo.fleet.notices"):
            with NoticeWatcher([broken, sig], got.append, interval_s=0.02):
                time.sleep(0.3)
                os.kill(os.getpid(), signal.SIGTERM)
                deadline = time.monotonic() + 5
                while not got and time.monotonic() < deadline:
                    time.sleep(0.02)
    finally:
        sig.close()
    assert [n.source for n in got] == ["sigterm"]
    warnings = [r for r in caplog.records if "gcp" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]


@pytest.mark.timeout(20)
def test_sigterm_handler_installed_and_restored():
    before = signal.getsignal(signal.SIGTERM)
    source = SigtermNotice(grace_s=30)
    try:
        assert signal.getsignal(signal.SIGTERM) != before
        assert source.poll() is None
        t0 = time.time()
        os.kill(os.getpid(), signal.SIGTERM)  # would end pytest without the handler
        notice = source.poll()
        assert notice is not None and notice.source == "sigterm"
        assert 29 <= notice.seconds_left() <= 30.5 and notice.deadline >= t0 + 29.9
    finally:
        source.close()
    assert signal.getsignal(signal.SIGTERM) == before


@pytest.mark.procs
@pytest.mark.timeout(30)
def test_sigterm_to_a_process_becomes_a_notice():
    """A separate process, as Kubernetes would signal it: it reports the notice and exits 0."""
    code = textwrap.dedent("""
        import sys, time
        from bamboo.fleet.notices import NoticeWatcher, SigtermNotice
        got = []
        with NoticeWatcher([SigtermNotice(grace_s=5)], got.append, interval_s=0.02):
            print("ready", flush=True)
            end = time.monotonic() + 15
            while not got and time.monotonic() < end:
                time.sleep(0.02)
        print(got[0].source if got else "none", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0, proc.returncode
    assert out.strip() == "sigterm"

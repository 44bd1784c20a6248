"""The membership suite, run against a real etcd (`bamboo coordinator --etcd`).

It needs `/usr/bin/etcd` (Debian's etcd-server); the session's `etcd_url` fixture starts
one on a free loopback port with a temporary data directory, and FAILS (never skips)
when the binary is missing. Each test uses its own job name, so tests do not see each
other's nodes.
"""
from __future__ import annotations

import threading
import time
import uuid

import pytest

from bamboo.node.membership import EtcdMembership, LeaseExpired, MembershipError, MembershipEvent
from support.servers import one_free_port as free_port

pytestmark = pytest.mark.procs  # every test here starts processes

TTL = 1.0
SLACK = 1.5  # expiry is seen within TTL + SLACK after the last heartbeat (etcd checks leases every 0.5 s)
TOKEN = "s3cret-token"


class Backend:
    """Makes a coordinator (`host`) and node clients (`client`) of one job in etcd."""

    def __init__(self, etcd_url: str) -> None:
        self.etcd_url = etcd_url
        self.job = "job-" + uuid.uuid4().hex[:8]
        self.opened: list = []

    def host(self, ttl_s: float = TTL, token: str = TOKEN):
        m = EtcdMembership.host(self.etcd_url, token, job=self.job, ttl_s=ttl_s)
        self.opened.append(m)
        return m

    def client(self):
        m = EtcdMembership.connect(self.etcd_url, job=self.job)
        self.opened.append(m)
        return m

    def close(self) -> None:
        for m in reversed(self.opened):
            m.close()


@pytest.fixture
def backend(etcd_url):
    b = Backend(etcd_url)
    yield b
    b.close()


def wait_for(cond, timeout: float) -> float:
    """Seconds until `cond()` held; fails after `timeout`."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not met in time"
        time.sleep(0.02)
    return time.monotonic() - t0


@pytest.mark.timeout(30)
def test_join_alive_leave(backend):
    coord = backend.host()
    a, b = backend.client(), backend.client()
    lease = a.join("n1", {"host": "10.0.0.1", "gpus": 1}, TOKEN)
    assert lease.node_id == "n1" and lease.ttl_s >= TTL
    b.join("n2", {"host": "10.0.0.2"}, TOKEN)
    assert coord.alive() == {"n1": {"host": "10.0.0.1", "gpus": 1}, "n2": {"host": "10.0.0.2"}}
    assert a.alive() == coord.alive()  # every client sees the same view
    a.leave("n1")
    assert coord.alive() == {"n2": {"host": "10.0.0.2"}}
    b.leave("n2")
    assert coord.alive() == {}


@pytest.mark.timeout(30)
def test_heartbeats_keep_a_node_and_silence_expires_it(backend):
    coord = backend.host()
    node = backend.client()
    node.join("n1", {}, TOKEN)
    end = time.monotonic() + 2.5 * TTL
    while time.monotonic() < end:  # well past the TTL, kept by heartbeats
        node.heartbeat("n1")
        time.sleep(TTL / 4)
    assert "n1" in coord.alive()
    node.heartbeat("n1")
    silent = wait_for(lambda: "n1" not in coord.alive(), TTL + SLACK)
    assert silent >= 0.5 * TTL, f"expired {silent:.2f} s after a heartbeat, TTL {TTL}"
    with pytest.raises(LeaseExpired, match="join again"):
        node.heartbeat("n1")
    node.join("n1", {"again": True}, TOKEN)  # an expired node may join again
    assert coord.alive() == {"n1": {"again": True}}


@pytest.mark.timeout(30)
def test_watch_reports_joined_left_expired(backend):
    coord = backend.host()
    events: list[MembershipEvent] = []
    lock = threading.Lock()

    def on_event(ev: MembershipEvent) -> None:
        with lock:
            events.append(ev)
    coord.watch(on_event)
    node = backend.client()
    node.join("n1", {"k": 1}, TOKEN)
    node.join("n2", {"k": 2}, TOKEN)
    node.leave("n1")
    deadline = time.monotonic() + TTL + SLACK + 1
    want = [("joined", "n1"), ("joined", "n2"), ("left", "n1"), ("expired", "n2")]
    while time.monotonic() < deadline:  # n2 never heartbeats: it expires
        with lock:
            if len(events) >= 4:
                break
        time.sleep(0.05)
    time.sleep(0.2)
    with lock:
        got = [(e.kind, e.node_id) for e in events]
    assert got == want
    assert events[0].info == {"k": 1} and events[3].info == {"k": 2}


@pytest.mark.timeout(30)
def test_wrong_token_is_refused(backend):
    coord = backend.host(token="right")
    node = backend.client()
    with pytest.raises(MembershipError, match="wrong join token") as info:
        node.join("n1", {}, "wrong")
    assert "\n" not in str(info.value)
    assert coord.alive() == {}


@pytest.mark.timeout(30)
def test_same_node_id_twice_is_refused(backend):
    coord = backend.host()
    backend.client().join("n1", {"first": True}, TOKEN)
    with pytest.raises(MembershipError, match="already a member"):
        backend.client().join("n1", {"second": True}, TOKEN)
    assert coord.alive() == {"n1": {"first": True}}


@pytest.mark.timeout(30)
def test_unreachable_backend_is_one_clear_line():
    port = free_port()  # nothing listens there
    with pytest.raises(MembershipError) as info:
        EtcdMembership.connect(f"http://127.0.0.1:{port}", timeout_s=1)
    text = str(info.value)
    assert "\n" not in text and f"127.0.0.1:{port}" in text and "unreachable" in text, text
    assert "start etcd" in text


@pytest.mark.timeout(30)
def test_client_of_a_missing_job_is_told_to_start_the_coordinator(etcd_url):
    with pytest.raises(MembershipError, match="start the coordinator first"):
        EtcdMembership.connect(etcd_url, job="no-such-job")

"""Preemption-notice sources against local HTTP servers that answer as the real endpoints do.

One shared suite runs over AWS (IMDSv2), GCP and Azure: first no notice, then a notice;
plus SIGTERM (to this process; to another one in
tests/integration/test_notice_processes.py), the watcher's once-per-notice callback, and its survival of failing sources.
"""
from __future__ import annotations

import logging
import os
import signal
import time

import pytest

from bamboo.node.notices import (
    AwsSpotNotice,
    AzurePreemptNotice,
    GcpPreemptedNotice,
    Notice,
    NoticeError,
    NoticeWatcher,
    SigtermNotice,
)
from support.servers import MetadataServer


@pytest.fixture
def metadata(request):
    server = MetadataServer(request.param).start()
    yield server
    server.stop()


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
        with caplog.at_level(logging.WARNING, logger="bamboo.node.notices"):
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

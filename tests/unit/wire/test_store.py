"""The run's store server: on the bind address only, its port given back when it closes."""
from __future__ import annotations

import errno
import gc
import os
import socket
from datetime import timedelta

import pytest

from bamboo.wire.store import serve_store

TIMEOUT = timedelta(seconds=5)


def _connects(family: socket.AddressFamily, host: str, port: int) -> bool:
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        return s.connect_ex((host, port)) == 0


def test_a_loopback_store_listens_on_ipv4_loopback_only() -> None:
    """torch's own server listens on `[::]`: every peer arrives as a mapped IPv6 address
    whose reverse lookup goes to DNS. This one takes IPv4 connections on its address alone."""
    store = serve_store("127.0.0.1", 0, TIMEOUT)
    store.set("key", "value")
    assert store.get("key") == b"value"
    assert _connects(socket.AF_INET, "127.0.0.1", store.port)
    if socket.has_ipv6:
        try:
            assert not _connects(socket.AF_INET6, "::1", store.port)
        except OSError as e:  # no IPv6 loopback here: nothing to reach
            assert e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT)


def test_the_port_is_free_again_once_the_store_is_gone() -> None:
    store = serve_store("127.0.0.1", 0, TIMEOUT)
    port = store.port
    del store
    gc.collect()
    assert not _connects(socket.AF_INET, "127.0.0.1", port)
    serve_store("127.0.0.1", port, TIMEOUT)  # the same fixed port, as a restarted coordinator


def test_a_port_in_use_is_an_error_that_leaves_no_descriptor_open() -> None:
    store = serve_store("127.0.0.1", 0, TIMEOUT)
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises((OSError, RuntimeError)):
        serve_store("127.0.0.1", store.port, TIMEOUT)
    assert len(os.listdir("/proc/self/fd")) == before
    store.set("still", "serving")
    assert store.get("still") == b"serving"

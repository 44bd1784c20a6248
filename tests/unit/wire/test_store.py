"""The run's store server: on the bind address only, its port given back when it closes."""
from __future__ import annotations

import errno
import gc
import os
import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from bamboo.wire.store import StoreConnections, serve_store

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


def test_a_formation_that_ended_leaves_its_connection_to_the_next() -> None:
    """Two formations at once take two connections; one that ended gives its own back, and
    the next formation takes that one (no new connection); keys under another generation's
    prefix on a reused connection stay apart."""
    server = serve_store("127.0.0.1", 0, TIMEOUT)
    pool = StoreConnections("127.0.0.1", server.port, TIMEOUT)
    first, second = pool.take(), pool.take()
    assert first is not second and pool.opened == 2
    dist.PrefixStore("gen1/a", first).set("k", "1")
    pool.give_back(first)
    again = pool.take()
    assert again is first and pool.opened == 2
    dist.PrefixStore("gen2/a", again).set("k", "2")
    assert server.get("gen1/a/k") == b"1" and server.get("gen2/a/k") == b"2"
    assert pool.take() is not second and pool.opened == 3  # `second` was never given back

"""Which local address and interface the collective backend binds."""
from __future__ import annotations

import pytest

from bamboo.node.netif import collective_binding, interface_of, route_address


def test_the_route_to_loopback_is_loopback() -> None:
    assert route_address("127.0.0.1") == "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.77") is None  # TEST-NET-1: on no interface here


def test_the_binding_follows_the_store_and_sets_nccl_unless_the_user_did(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    assert collective_binding("localhost", 29401) == ("127.0.0.1", "lo")
    import os
    assert os.environ["NCCL_SOCKET_IFNAME"] == "lo"
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth7")
    collective_binding("127.0.0.1", 29401)
    assert os.environ["NCCL_SOCKET_IFNAME"] == "eth7"


def test_gloo_socket_ifname_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth3,eth4")
    assert collective_binding("127.0.0.1", 29401) == (None, "eth3")

"""Which local address and interface reach the other nodes.

gloo binds the address its host name resolves to unless told otherwise, which in a
container or a fresh VM is often 127.0.0.1: peers on other machines then cannot connect
and the group never forms. A worker therefore asks the kernel which local address routes
to the coordinator's store (a UDP `connect` sends nothing) and binds its collective
backend there; `GLOO_SOCKET_IFNAME` and `NCCL_SOCKET_IFNAME`, when the user set them,
win.
"""
from __future__ import annotations

import fcntl
import os
import socket
import struct

__all__ = ["route_address", "interface_of", "collective_binding"]

_SIOCGIFADDR = 0x8915


def route_address(host: str, port: int = 9) -> str:
    """The local IPv4 address the kernel would use to reach `host`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return str(s.getsockname()[0])


def interface_of(address: str) -> str | None:
    """The name of the interface holding IPv4 `address`, if any."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
        if socket.inet_ntoa(raw[20:24]) == address:
            return name
    return None


def collective_binding(store_host: str, store_port: int) -> tuple[str | None, str | None]:
    """(address, interface) the collective backend should use to reach the other nodes:
    (None, the user's interface) when GLOO_SOCKET_IFNAME is set, else the address that
    routes to the store and its interface. Also sets NCCL_SOCKET_IFNAME to that interface
    unless the user set it."""
    user = os.environ.get("GLOO_SOCKET_IFNAME")
    if user:
        return None, user.split(",")[0]
    address = route_address(socket.gethostbyname(store_host), store_port)
    interface = interface_of(address)
    if interface and not os.environ.get("NCCL_SOCKET_IFNAME"):
        os.environ["NCCL_SOCKET_IFNAME"] = interface
    return address, interface

"""The run's TCPStore server, on a listening socket of the bind address's own family.

Left to itself, torch's store server listens on every address at once (`[::]`), so every
connection it accepts comes from an IPv4-mapped IPv6 address (`::ffff:127.0.0.1`). The
server names each peer it accepts with `getnameinfo`, a reverse lookup that /etc/hosts
cannot answer for a mapped address: it goes to the DNS server, and where a reply is lost
the resolver waits out its 5 s timeout while the whole store, and every worker forming a
process group through it, waits behind it (measured on a sandbox whose DNS drops a few
replies: 7 stalls of 5.0 s in 90 connections; none with this socket). An IPv4 socket on
the bind address makes the peers plain IPv4 addresses, which /etc/hosts answers for
loopback, and keeps a local run's store off the network.
"""
from __future__ import annotations

import socket
from collections import deque
from datetime import timedelta

import torch.distributed as dist

__all__ = ["serve_store", "StoreConnections"]


def serve_store(host: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """The store's server on `host`:`port` (0: a free port); OSError or RuntimeError when
    it cannot listen there."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(socket.SOMAXCONN)
        store = dist.TCPStore(host, listener.getsockname()[1], is_master=True,
                              wait_for_workers=False, timeout=timeout,
                              master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store closes the descriptor when it is destroyed
    return store


class StoreConnections:
    """Client connections to the run's store for process-group formations. A formation
    takes a connection no other call is using (`take`: a spare one, or a new one) and gives
    it back when it ends (`give_back`), so a node opens as many connections as it ever forms
    groups at once instead of one per group. An abandoned or failed formation keeps its own:
    a wait buried with it would otherwise hold a connection shared with the next one."""

    def __init__(self, host: str, port: int, timeout: timedelta) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self.spare: deque[dist.TCPStore] = deque()
        self.opened = 0
        """Connections opened so far."""

    def take(self) -> dist.TCPStore:
        try:
            return self.spare.popleft()
        except IndexError:
            self.opened += 1
            return dist.TCPStore(self.host, self.port, is_master=False, timeout=self.timeout)

    def give_back(self, store: dist.TCPStore) -> None:
        self.spare.append(store)

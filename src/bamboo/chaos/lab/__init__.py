"""A lab of real hosts on one Linux machine, built from network namespaces (``bamboo lab``).

Each host is a network namespace with its own loopback and one veth link to a Linux bridge
in a "switch" namespace; the hosts' addresses live in a private /24 that exists only inside
these namespaces, so the machine's own addresses and routes are never touched. Processes
started in a host see only that host's network: they reach other hosts through the bridge
addresses, never over 127.0.0.1. Faults are real: a host's link can be cut, its bandwidth
capped (tc tbf), its latency raised (tc netem, where the kernel has it), and every process
in it killed at once, as when a spot instance is reclaimed.

    from bamboo.chaos.lab import Lab
    with Lab(hosts=3) as lab:                  # coord, a1, a2
        server = lab.run("a1", ["python3", "-m", "http.server", "8000"])
        lab.cap("a1", "8mbit")
        lab.cut("a2"); lab.reconnect("a2")
        lab.kill_host("a1")

Needs root and iproute2 (`ip`, and `tc` for cap/delay); `unsupported_reason()` says why not.
"""

from .hosts import (
                    Host,
                    Lab,
                    LabError,
                    NetemUnavailable,
                    lab_prefix,
                    leftover_namespaces,
                    unsupported_reason,
)

__all__ = ["Host", "Lab", "LabError", "NetemUnavailable", "lab_prefix", "leftover_namespaces",
           "unsupported_reason"]

"""Raw TCP copy speed between two hosts of a `bamboo.chaos.lab` lab, uncapped and capped.

Host "coord" sends N bytes to a sink in host "a1" over the lab's bridge (veth -> bridge ->
veth, plain sockets, no bamboo code), timed from connect to the sink's answer; each case
is repeated and the median shown, with the share of the cap reached. Every case is bounded:
a capped case sends at most --seconds worth of its rate, an uncapped one --size-mb.
(To be extended with state-transfer figures: a stage's weights and optimizer state between
two lab hosts.) Needs root.

    .venv/bin/python benchmarks/lab_transfer.py
    .venv/bin/python benchmarks/lab_transfer.py --caps 1gbit,100mbit,8mbit --repeats 5 --json
"""
from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bamboo.chaos.lab import Lab, unsupported_reason
from bamboo.chaos.lab.hosts import parse_rate

PORT = 29556

SINK = textwrap.dedent("""
    import socket, sys
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", int(sys.argv[1])))
    s.listen(4)
    print("ready", flush=True)
    while True:
        c, _ = s.accept()
        with c:
            n = 0
            while data := c.recv(1 << 20):
                n += len(data)
            c.sendall(str(n).encode())
""")

SEND = textwrap.dedent("""
    import socket, sys, time
    addr, port, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    chunk = b"x" * (1 << 20)
    t = time.perf_counter()
    c = socket.create_connection((addr, port), timeout=60)
    left = size
    while left:
        left -= c.send(chunk[:min(left, len(chunk))])
    c.shutdown(socket.SHUT_WR)
    n = int(c.recv(100))
    assert n == size, (n, size)
    print(time.perf_counter() - t)
""")


def measure(lab: Lab, size: int, repeats: int, timeout: float) -> list[float]:
    """Seconds of `repeats` copies of `size` bytes from coord to a1."""
    out = []
    for _ in range(repeats):
        r = lab.call("coord", [sys.executable, "-c", SEND, lab["a1"].address, str(PORT), str(size)],
                     timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"copy failed: {r.stderr.strip() or r.stdout.strip()}")
        out.append(float(r.stdout))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--caps", default="100mbit,8mbit", help="comma list of tc rates to cap a1 at")
    p.add_argument("--size-mb", type=float, default=64.0, help="bytes per uncapped copy (MB)")
    p.add_argument("--seconds", type=float, default=3.0,
                   help="a capped copy sends at most this many seconds of its rate")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args = p.parse_args()
    reason = unsupported_reason()
    if reason is not None:
        print(f"lab_transfer: {reason}", file=sys.stderr)
        return 2
    caps = [c for c in args.caps.split(",") if c]
    for c in caps:
        parse_rate(c)
    rows = []
    with Lab(2) as lab:
        sink = lab.run("a1", [sys.executable, "-c", SINK, str(PORT)], stdout=subprocess.PIPE,
                       text=True)
        if sink.stdout.readline().strip() != "ready":
            raise RuntimeError("the sink did not start")
        for cap in [None, *caps]:
            if cap is None:
                size = int(args.size_mb * 1e6)
            else:
                lab.cap("a1", cap)
                per_s = parse_rate(cap) / 8
                size = max(64 * 1024, int(min(args.size_mb * 1e6, per_s * args.seconds)))
            # a copy may take 4x its nominal time (plus start-up) before it is a failure
            nominal = size / (parse_rate(cap) / 8) if cap else 1.0
            times = measure(lab, size, args.repeats, timeout=30 + 4 * nominal)
            t = statistics.median(times)
            mbps = size / t / 1e6
            rows.append({"cap": cap or "none", "bytes": size, "seconds": t, "MB_s": mbps,
                         "of_cap": (mbps * 1e6 * 8 / parse_rate(cap)) if cap else None,
                         "all_seconds": times})
            if cap is not None:
                lab.uncap("a1")
        sink.send_signal(signal.SIGKILL)
        sink.wait(timeout=10)
        sink.stdout.close()
    print(f"{'cap':>10} {'MB':>8} {'s (median)':>11} {'MB/s':>9} {'of cap':>7}")
    for r in rows:
        share = f"{r['of_cap']:.0%}" if r["of_cap"] is not None else "-"
        print(f"{r['cap']:>10} {r['bytes'] / 1e6:>8.2f} {r['seconds']:>11.3f} {r['MB_s']:>9.1f} "
              f"{share:>7}")
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
